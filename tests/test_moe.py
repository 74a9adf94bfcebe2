"""Mixture of Experts with expert parallelism: pretrain_gpt.py on megatron-core's MoE layers.

A small MoE GPT (8 experts, top-2, dropless; layers 1, 2 and 4 MoE, layer 3 dense), 6 iterations.
Eight launches:
  ep1           1 rank, allgather dispatcher, TensorBoard; saves at 2, 4, 6
  ep2           EP2 x DP2 (2 ranks), alltoall dispatcher, from ep1's iteration 2; saves at 4, 6;
                bytes per process group
  ep2_tp2       EP2 x TP2 x sequence parallel (4 ranks, expert TP 2) from ep1's iteration 2
  ep1_from_ep2  1 rank from ep2's iteration 4 (each rank's four experts gathered into eight)
  ep4_from_ep2  EP4 x expert TP1 folded over TP2 x DP2 (4 ranks) from ep2's iteration 4
  ep2_resumed   EP2 resuming ep2's iteration 4: bit-exact
  features x2   shared experts, seq aux loss, aux-loss-free bias, sigmoid scores, z-loss, capacity
                with padding and dropping, --moe-grouped-gemm: 1 rank (saves at 2), then EP2 from it
Layouts are compared from a common checkpoint: megatron-core initialises each EP rank's experts
from its own expert-parallel RNG seed (as each TP shard from its own), so from scratch EP2 is a
different (equally valid) draw; tests/test_pretrain_gpt.py does the same for TP.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from pretrain_runs import NO_DROPOUT, checkpoint_at, metrics, pretrain, train_losses

from megatron_npu.layout.moe import moe_layer_pattern
from megatron_npu.layout.parallel_dims import TRAINER_FLAGS, LayoutError, ParallelDims
from megatron_npu.layout.planner import ModelSpec, expert_all_to_all_bytes, plan
from megatron_npu.layout.rankmap import build_rank_map
from megatron_npu.training import arguments
from megatron_npu.training.arguments import ConfigError
from megatron_npu.training.moe_args import moe_freq_type

MOE = [
    "--train-iters",
    "6",
    *NO_DROPOUT,
    "--disable-bias-linear",
    "--num-experts",
    "8",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "0.01",
    "--moe-layer-freq",
    "[1,1,0,1]",
]
SAVE_AT_2 = ["--save-interval", "2"]
NO_BIAS = ["--disable-bias-linear"]
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
EP2 = ["--expert-model-parallel-size", "2", *ALLTOALL]
FEATURES = [
    "--moe-shared-expert-intermediate-size",
    "64",
    "--moe-ffn-hidden-size",
    "96",
    "--moe-router-load-balancing-type",
    "seq_aux_loss",
    "--moe-router-enable-expert-bias",
    "--moe-router-score-function",
    "sigmoid",
    "--moe-z-loss-coeff",
    "0.001",
    "--moe-expert-capacity-factor",
    "1.0",
    "--moe-token-drop-policy",
    "probs",
    "--moe-pad-expert-input-to-capacity",
    "--moe-grouped-gemm",
]
MOE_LINE = re.compile(r" lm loss: \d\.\d{6}E[-+]\d\d \| load_balancing_loss: \d\.\d{6}E[-+]\d\d \| loss scale:")


def _run(tmp_path_factory, name: str, *flags: str, nproc: int = 1, load_from=None, save=False, tensorboard=False):
    """``load_from``: (run, iteration) of an earlier run's checkpoint."""
    run = tmp_path_factory.mktemp(name)
    extra: list[str] = ["--tensorboard-dir", str(run / "tb")] if tensorboard else []
    if load_from is not None:
        source, iteration = load_from
        extra += ["--load", str(checkpoint_at(source / "ckpt", iteration, run / "load"))]
    if save:
        extra += ["--save", str(run / "ckpt"), *SAVE_AT_2]
    job = pretrain(run, *MOE, *extra, *flags, nproc=nproc).check()
    return run, job


@pytest.fixture(scope="module")
def ep1(tmp_path_factory):
    return _run(tmp_path_factory, "ep1", save=True, tensorboard=True)


@pytest.fixture(scope="module")
def ep2(ep1, tmp_path_factory):
    return _run(tmp_path_factory, "ep2", *EP2, "--timing-log-level", "2", nproc=2, save=True, load_from=(ep1[0], 2))


def _after(run, iteration: int) -> dict[int, float]:
    return {i: v for i, v in train_losses(run).items() if i > iteration}


def _moe_losses(run) -> dict[int, float]:
    return {m["iteration"]: m["load_balancing_loss"] for m in metrics(run) if "load_balancing_loss" in m}


# ---- one launch each ---------------------------------------------------------------------------
def test_moe_iteration_line_and_tensorboard_carry_megatron_lms_aux_loss(ep1):
    run, job = ep1
    lines = [line for line in job.stdout.splitlines() if "elapsed time per iteration" in line]
    assert len(lines) == 6 and all(MOE_LINE.search(line) for line in lines)
    aux = _moe_losses(run)
    assert sorted(aux) == [1, 2, 3, 4, 5, 6] and all(0.5 < v < 2.0 for v in aux.values())  # ~1 when balanced
    assert "moe_ffn_hidden_size is not set" in job.stdout + job.stderr  # Megatron-LM's warning
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run / "tb"))
    tb.Reload()
    assert "load_balancing_loss" in tb.Tags()["scalars"]
    assert [e.value for e in tb.Scalars("load_balancing_loss")] == pytest.approx([aux[i] for i in range(1, 7)])


def test_ep1_checkpoint_trains_on_under_ep2_dp2_with_the_alltoall_dispatcher(ep1, ep2):
    run, job = ep2
    assert train_losses(run) == pytest.approx(_after(ep1[0], 2), rel=1e-5)
    ep1_aux = {i: v for i, v in _moe_losses(ep1[0]).items() if i > 2}
    assert _moe_losses(run) == pytest.approx(ep1_aux, rel=1e-5)
    assert "resharding" in job.stdout


def test_ep1_checkpoint_trains_on_under_ep2_x_tp2_with_sequence_parallel(ep1, tmp_path_factory):
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    run, _ = _run(tmp_path_factory, "ep2_tp2", *EP2, *tp2, nproc=4, load_from=(ep1[0], 2))
    assert train_losses(run) == pytest.approx(_after(ep1[0], 2), rel=1e-5)
    args = json.loads((run / "logs" / "args.json").read_text())
    assert (args["expert_model_parallel_size"], args["expert_tensor_parallel_size"]) == (2, 2)


def test_ep2_checkpoint_loads_under_ep1(ep1, ep2, tmp_path_factory):
    run, _ = _run(tmp_path_factory, "ep1_from_ep2", load_from=(ep2[0], 4))
    assert train_losses(run) == pytest.approx(_after(ep2[0], 4), rel=1e-5)
    assert train_losses(run) == pytest.approx(_after(ep1[0], 4), rel=1e-5)


def test_ep2_checkpoint_loads_under_ep4_folded_over_tp2(ep2, tmp_path_factory):
    """MoE parallel folding: attention TP2 x DP2, experts EP4 x expert TP1 on the same 4 ranks."""
    folded = ["--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1", *ALLTOALL]
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    run, _ = _run(tmp_path_factory, "ep4_from_ep2", *folded, *tp2, nproc=4, load_from=(ep2[0], 4))
    assert train_losses(run) == pytest.approx(_after(ep2[0], 4), rel=1e-5)


def test_ep2_resume_reproduces_the_uninterrupted_run_exactly(ep2, tmp_path_factory):
    run, _ = _run(tmp_path_factory, "ep2_resumed", *EP2, nproc=2, load_from=(ep2[0], 4))
    assert train_losses(run) == _after(ep2[0], 4)
    assert _moe_losses(run) == {i: v for i, v in _moe_losses(ep2[0]).items() if i > 4}


def test_planner_expert_all_to_all_bytes_are_the_bytes_measured(ep2):
    """Dropless top-2, TP1: each MoE layer's dispatch and combine send every local token-expert pair
    once, forward and backward; counted by torch.distributed's all_to_all_single on the EP group."""
    run, _ = ep2
    expected = expert_all_to_all_bytes(
        micro_batch_size=2,
        seq_length=32,
        hidden_size=64,
        topk=2,
        moe_layers=sum(moe_layer_pattern([1, 1, 0, 1], 4)),
        microbatches=2,  # 8 / (2 x DP 2)
        dtype_bytes=4,
    )
    assert expected == (4 * (2 * 32 * 2) * 64 * 4 + 2 * (2 * 32 * 2) * 4) * 3 * 2
    model = ModelSpec(4, 64, 4, 32, 2, 8, 128, add_bias_linear=False, params_dtype="fp32", num_experts=8)
    model.moe_layer_freq = [1, 1, 0, 1]
    comm_plan = plan(model, build_rank_map(world_size=2, ep=2, num_experts=8))
    per_rank = []
    for rank in (0, 1):
        timers = (run / "logs" / "timers" / f"rank{rank:05d}.jsonl").read_text().splitlines()
        measured = [json.loads(line)["comm"]["ep"]["bytes"] for line in timers]
        assert comm_plan.ranks[rank].by_label()["ep"]["bytes"] == expected
        per_rank.append(measured)
    # each rank's own figure follows the routing (what it receives); the EP group's sum does not
    assert [a + b for a, b in zip(*per_rank, strict=True)] == [2 * expected] * 4


def test_capacity_dropping_and_the_other_router_options_agree_across_ep(tmp_path_factory):
    """With a capacity factor each router caps the tokens per expert of the micro-batch it sees
    (megatron-core sizes the capacity from the router's own tokens), so layouts that give each
    router the same tokens (EP, DP) drop the same ones; sequence parallelism (TP > 1) shows each
    router a slice of the sequence and drops differently, so TP layouts are not expected equal."""
    single, _ = _run(tmp_path_factory, "features_ep1", *FEATURES, *ALLTOALL, save=True)
    parallel, job = _run(tmp_path_factory, "features_ep2", *FEATURES, *EP2, nproc=2, load_from=(single, 2))
    assert train_losses(parallel) == pytest.approx(_after(single, 2), rel=1e-5)
    names = {k for m in metrics(parallel) for k in m if k.endswith("loss") and k != "lm_loss"}
    assert names == {"seq_load_balancing_loss", "z_loss"}  # only what was asked (see reporting.py)
    assert "seq_load_balancing_loss:" in job.stdout and " load_balancing_loss:" not in job.stdout


# ---- no launch ---------------------------------------------------------------------------------
def test_moe_flag_defaults_are_megatron_cores():
    from megatron.core.transformer import TransformerConfig

    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    args = arguments.build_parser().parse_args([])
    from megatron_npu.training.config import MOE_FIELDS

    for name in (*MOE_FIELDS, "expert_model_parallel_size", "expert_tensor_parallel_size"):
        assert getattr(args, name) == defaults[name], name
    assert args.num_experts is None


def test_moe_layer_freq_reads_as_megatron_lm():
    assert moe_freq_type("2") == 2
    assert moe_freq_type("([1]*3+[0]*1)*2") == [1, 1, 1, 0, 1, 1, 1, 0]
    assert moe_layer_pattern(2, 4) == [True, False, True, False]
    with pytest.raises(Exception, match="only integers"):
        moe_freq_type("__import__('os')")


def _parse(*flags: str, world_size: int = 1):
    base = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
    base += ["--micro-batch-size", "1", "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer"]
    base += ["--vocab-size", "128", "--lr", "1e-3"]
    return arguments.parse_args([*base, *flags], world_size=world_size, check_paths=False)


@pytest.mark.parametrize(
    "flags,world,message",
    [
        (["--num-experts", "6", "--expert-model-parallel-size", "4", *NO_BIAS], 4, r"--num-experts 6 is not divisible"),
        (
            [
                "--num-experts",
                "8",
                "--expert-model-parallel-size",
                "4",
                "--pipeline-model-parallel-size",
                "2",
                *NO_BIAS,
            ],
            4,
            r"world size 4 is not divisible by --expert-tensor-parallel-size 1 x --expert-model-parallel-size 4 x "
            r"--pipeline-model-parallel-size 2 = 8",
        ),
        (["--expert-model-parallel-size", "2"], 2, r"--expert-model-parallel-size 2 needs --num-experts"),
        (["--num-experts", "8"], 1, r"needs --disable-bias-linear"),
        (["--num-experts", "4", "--disable-bias-linear", "--moe-router-topk", "5"], 1, r"--moe-router-topk 5"),
        (["--num-experts", "4", "--disable-bias-linear", "--moe-layer-freq", "[1,0]"], 1, r"gives 2 layers"),
        (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"], 1, r"DeepEP"),
        (["--num-experts", "4", "--moe-permute-fusion"], 1, r"--moe-permute-fusion is not supported"),
    ],
)
def test_moe_layouts_and_flags_that_cannot_work_are_one_message(flags, world, message):
    with pytest.raises(ConfigError, match=message):
        _parse(*flags, world_size=world)


def test_moe_parallel_folding_layout():
    """megatron-core 0.16's expert grid is its own: EP need not divide the attention's DP."""
    dims = ParallelDims(4, tp=4, ep=4, etp=1, num_experts=8, flags=TRAINER_FLAGS)
    assert (dims.dp, dims.expert_tp, dims.expert_dp, dims.experts_per_rank) == (1, 1, 1, 2)
    assert ParallelDims(8, tp=2, ep=2, num_experts=8).expert_dp == 2  # expert TP defaults to TP
    with pytest.raises(LayoutError):
        ParallelDims(8, tp=2, ep=8, num_experts=8)
    args = _parse("--num-experts", "8", "--disable-bias-linear", "--expert-model-parallel-size", "2", world_size=2)
    assert args.expert_tensor_parallel_size == 1 and args.moe_ffn_hidden_size == args.ffn_hidden_size


def test_migrate_keeps_moe_flags_and_drops_the_cuda_only_fusions():
    from megatron_npu.migrate.bash import migrate_bash

    script = (
        "torchrun --nproc_per_node 8 pretrain_gpt.py --num-experts 8 --moe-router-topk 2 "
        "--expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-permute-fusion\n"
    )
    text = migrate_bash(script).text
    for kept in ("--num-experts 8", "--moe-router-topk 2", "--expert-model-parallel-size 4", "alltoall"):
        assert kept in text
    assert "--moe-grouped-gemm" in text and "--moe-permute-fusion" not in text


def test_perf_report_shows_the_expert_all_to_all_next_to_the_plan(ep2):
    import contextlib
    import io

    from megatron_npu.perf import report as perf_report

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert perf_report.main([str(ep2[0] / "logs"), "--json"]) == 0
    checks = json.loads(out.getvalue())["checks"]
    ep = checks["traffic"]["dimensions"]["ep"]
    assert ep["dimension"] == "expert all-to-all (EP)" and ep["planned_bytes"] == ep["measured_bytes"] > 0
    assert checks["traffic"]["dimensions"]["edp"]["measured_bytes"] > 0  # the experts' own gradient reduction
    assert 0 < checks["communication"]["expert_all_to_all_s"]
