"""The trainer's npu branches run end to end on the host, against the reference torch_npu, and give the cpu target's
losses.

``MEGATRON_NPU_DEVICE=npu`` with the test switch ``MEGATRON_NPU_EMULATE=1`` and tests/npu_emulation/ on PYTHONPATH
(its sitecustomize answers ``import torch_npu`` with tests/accelerator/npu_reference.py and maps NpuAccelerator onto
the host: docs/npu-emulation.md). Each layout runs once on each target, all four launches at once:

- TP2 x PP2 with --sequence-parallel, --use-flash-attn and --reset-attention-mask on the bundled corpus (documents of
  about 150 tokens, so a 64-token sample holds document boundaries), a sliding window on layer 1 (stage 0) and full
  attention on layer 2 (stage 1): npu_fusion_attention in band mode (sparse_mode 4) and with document masks
  (sparse_mode 0), RoPE / RMSNorm / SwiGLU kernels, MoE with EP2 and --moe-grouped-gemm (npu_grouped_matmul
  forward and backward);
- CP2 with --cp-comm-type p2p a2a (ring attention on layer 1 with the sliding window, Ulysses on layer 2): the
  attention blocks on npu_fusion_attention / npu_fusion_attention_grad (the blocks the window cuts in band mode,
  sparse_mode 4) and their merge on npu_ring_attention_update, EP2 grouped GEMM.

Each emulated rank writes the operators it called (by kind), so the test also shows which branches ran. Reverting
ops/attention.py's document-mask fix (the fused path dropping ``attention_mask``) fails the loss comparison.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from distributed import ROOT, base_env, torchrun
from pretrain_runs import PRETRAIN, train_losses

EMULATION = ROOT / "tests" / "npu_emulation"
REL = 1e-5
ITERATIONS = 3

BASE = [
    *"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64".split(),
    *"--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine".split(),
    *"--lr-warmup-iters 1 --seed 1234 --log-interval 1 --eval-iters 0 --num-workers 0".split(),
    *f"--train-iters {ITERATIONS} --attention-dropout 0 --hidden-dropout 0".split(),
    *"--position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear".split(),
    *"--group-query-attention --num-query-groups 2".split(),
    *"--num-experts 4 --expert-model-parallel-size 2 --moe-grouped-gemm --moe-router-topk 2".split(),
    *"--moe-token-dispatcher-type alltoall".split(),
]
#: layout -> (ranks, flags)
LAYOUTS = {
    "tp2_pp2_flash_document_masks": (
        4,
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
        "--expert-tensor-parallel-size 1 --use-flash-attn --reset-attention-mask --reset-position-ids "
        "--eod-mask-loss --window-size 16,0 --window-attn-skip-freq 2".split(),
    ),
    "cp2_p2p_a2a": (
        2,
        "--context-parallel-size 2 --cp-comm-type p2p a2a --window-size 16,0 --window-attn-skip-freq 2".split(),
    ),
}


def _data_flags(folder: Path) -> list[str]:
    from megatron_npu.data import DEMO_TOKENIZER_MODEL, ensure_demo_dataset

    prefix = ensure_demo_dataset(str(folder))
    return ["--data-path", prefix, "--split", "98,2,0", "--tokenizer-type", "GPTSentencePieceTokenizer"] + [
        "--tokenizer-model",
        DEMO_TOKENIZER_MODEL,
    ]


def _env(target: str, run_dir: Path) -> dict[str, str]:
    if target == "cpu":
        return base_env()
    env = base_env(MEGATRON_NPU_DEVICE="npu", MEGATRON_NPU_EMULATE="1")
    env["MEGATRON_NPU_EMULATION_LOG"] = str(run_dir / "calls")
    env["PYTHONPATH"] = f"{EMULATION}:{env['PYTHONPATH']}"
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """(layout, target) -> run folder; the four launches run at once (one torchrun job each)."""
    root = tmp_path_factory.mktemp("npu_emulated")
    data = _data_flags(root / "data")
    jobs = {}
    with ThreadPoolExecutor(max_workers=len(LAYOUTS) * 2) as pool:
        for layout, (ranks, flags) in LAYOUTS.items():
            for target in ("cpu", "npu"):
                run_dir = root / f"{layout}_{target}"
                args = [*BASE, *flags, *data, "--log-dir", str(run_dir / "logs")]
                env = _env(target, run_dir)
                jobs[layout, target] = (run_dir, pool.submit(torchrun, PRETRAIN, *args, nproc=ranks, env=env))
    for _, job in jobs.values():
        job.result().check()
    return {key: run_dir for key, (run_dir, _) in jobs.items()}


def _calls(run_dir: Path) -> dict[int, dict[str, int]]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted((run_dir / "calls").glob("rank*.json"))}


def _relative_errors(npu: dict[int, float], cpu: dict[int, float]) -> dict[int, float]:
    assert npu.keys() == cpu.keys() == set(range(1, ITERATIONS + 1)), (npu, cpu)
    return {i: abs(npu[i] - cpu[i]) / abs(cpu[i]) for i in cpu}


@pytest.mark.launch
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_emulated_npu_target_trains_as_the_cpu_target(runs, layout):
    errors = _relative_errors(train_losses(runs[layout, "npu"]), train_losses(runs[layout, "cpu"]))
    print(f"{layout}: relative loss errors per iteration {errors}")
    assert max(errors.values()) <= REL, errors


@pytest.mark.launch
def test_the_npu_branches_ran_on_the_reference_operators(runs):
    flash = _calls(runs["tp2_pp2_flash_document_masks", "npu"])
    cp = _calls(runs["cp2_p2p_a2a", "npu"])
    assert sorted(flash) == [0, 1, 2, 3] and sorted(cp) == [0, 1]
    forwards = ITERATIONS * 4  # 4 micro-batches, one layer a stage
    for rank, calls in flash.items():
        # every forward of core attention on the fused kernel: the window layer as the band over the compressed
        # mask (stage 0: ranks 0, 1), the full layer with megatron's document mask (stage 1: ranks 2, 3)
        kind = "sparse_mode=4 mask=compressed" if rank < 2 else "sparse_mode=0 mask=document"
        assert calls[f"npu_fusion_attention {kind}"] == forwards, calls
        assert calls["npu_grouped_matmul group_type=0 group_list_type=1"] > 0  # fc1 / fc2 and their dx
        assert calls["npu_grouped_matmul group_type=2 group_list_type=1"] > 0  # the weight gradients
        assert {"npu_rms_norm", "npu_rotary_mul", "npu_swiglu"} <= calls.keys()
    for calls in cp.values():
        # ring (layer 1, the sliding window): the diagonal blocks causal, the blocks the window cuts as its band
        # (sparse_mode 4), merged; Ulysses (layer 2, full attention): one causal block
        assert calls["npu_fusion_attention sparse_mode=0 mask=causal"] > 0
        assert calls["npu_fusion_attention sparse_mode=4 mask=compressed"] > 0
        assert calls["npu_fusion_attention_grad sparse_mode=0 mask=causal"] > 0
        assert calls["npu_fusion_attention_grad sparse_mode=4 mask=compressed"] > 0
        assert calls["npu_ring_attention_update"] > 0
    assert not (runs["cp2_p2p_a2a", "cpu"] / "calls").exists()  # the cpu target never imported torch_npu
