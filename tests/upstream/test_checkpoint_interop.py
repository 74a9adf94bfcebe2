"""A run moves between this project's pretrain_gpt.py and Megatron-LM core_v0.16.1's own (unmodified,
through ``-m megatron_npu.run``), in either direction and under another layout.

Each trainer's checkpoint carries Megatron-LM's fields (``args`` with the consumed samples,
``checkpoint_version``, ``iteration``, ``rng_state``, content metadata): the trainer that continues
takes the data position, optimizer and scheduler (and, under the same layout, the RNG states) and its
iterations after the resume equal the uninterrupted run's. fp32, no dropout, tests/pretrain_runs.py's
small GPT: TP2 x PP2 here, one rank in Megatron-LM's.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from distributed import ROOT, Job, base_env, run, torchrun
from megatron_lm_checkout import NEEDS_EXTRACT, upstream
from pretrain_runs import MOCK_DATA, NO_DROPOUT, checkpoint_at
from pretrain_runs import MODEL as PROJECT_MODEL

pytestmark = [
    pytest.mark.launch,
    NEEDS_EXTRACT,
]

MODEL = [*PROJECT_MODEL, "--eval-interval", "1000", *NO_DROPOUT, *MOCK_DATA, "--train-iters", "6"]
MODEL += ["--use-distributed-optimizer"]
TP2_PP2 = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
MEGATRON_FSDP = (
    "--use-megatron-fsdp",
    *("--data-parallel-sharding-strategy", "optim_grads_params", "--ckpt-format", "fsdp_dtensor"),
    "--untie-embeddings-and-output-weights",
)
SAVE_AT, RESUMED = 3, (4, 5, 6)
SAMPLES_PER_STEP = 8  # --global-batch-size
# Megatron-LM's iteration line, which this trainer prints too
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*?lm loss: ([0-9.Ee+-]+)")


def iterations(job: Job) -> dict[int, tuple[int, float]]:
    """(consumed samples, lm loss) by iteration, from the printed iteration lines."""
    found = {int(m[1]): (int(m[2]), float(m[3])) for m in map(LINE.search, job.stdout.splitlines()) if m}
    assert found, f"no iteration lines\n{job.stdout[-3000:]}\n{job.stderr[-3000:]}"
    return found


def ours(*flags: str, nproc: int) -> Job:
    return torchrun(ROOT / "pretrain_gpt.py", *MODEL, *flags, nproc=nproc, env=base_env(), timeout=600).check()


def assert_resumed(resumed: dict, uninterrupted: dict, *, first_loss_pair_averaged: bool) -> None:
    """The resumed iterations continue the uninterrupted run: the same data position, losses within
    rel 1e-5. Megatron-LM's training_log prints as a process's second lm loss the mean of its first
    two iterations' (the accumulator is not reset after the first line): a resumed Megatron-LM
    prints mean(4, 5) at iteration 5."""
    assert sorted(resumed) == list(RESUMED)
    for iteration in RESUMED:
        assert resumed[iteration][0] == uninterrupted[iteration][0] == iteration * SAMPLES_PER_STEP
        expected = uninterrupted[iteration][1]
        if first_loss_pair_averaged and iteration == RESUMED[1]:
            expected = (uninterrupted[RESUMED[0]][1] + expected) / 2
        assert resumed[iteration][1] == pytest.approx(expected, rel=1e-5), (iteration, resumed, uninterrupted)


@pytest.fixture(scope="module")
def ours_tp2_pp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """This trainer, TP2 x PP2, 6 iterations, a checkpoint at 3: (iterations, save root)."""
    save = tmp_path_factory.mktemp("ours") / "ckpt"
    job = ours(*TP2_PP2, "--save", str(save), "--save-interval", str(SAVE_AT), nproc=4)
    return iterations(job), save


@pytest.fixture(scope="module")
def megatron_lm_run(megatron_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """Megatron-LM's pretrain_gpt.py, one rank, 6 iterations, checkpoints at 3 and 6. Its
    distributed optimizer saved fully reshardable (Megatron-LM's default, dp_reshardable, loads only
    under the layout that saved it: this trainer says so and names the flag)."""
    save = tmp_path_factory.mktemp("megatron-lm") / "ckpt"
    flags = ("--save", str(save), "--save-interval", str(SAVE_AT), "--dist-ckpt-optim-fully-reshardable")
    return iterations(upstream(megatron_lm, *MODEL, *flags, nproc=1).check()), save


def test_a_tp2_pp2_checkpoint_of_this_trainer_resumes_in_megatron_lm(megatron_lm, ours_tp2_pp2, tmp_path):
    uninterrupted, save = ours_tp2_pp2
    load = checkpoint_at(save, SAVE_AT, tmp_path / "ckpt")
    job = upstream(megatron_lm, *MODEL, "--load", str(load), nproc=1).check()
    assert f"successfully loaded checkpoint from {load} [ t 1/1, p 1/1 ] at iteration {SAVE_AT}" in job.stdout
    assert "could not find arguments in the checkpoint" not in job.stdout  # the consumed samples came from args
    assert_resumed(iterations(job), uninterrupted, first_loss_pair_averaged=True)


def test_a_megatron_lm_checkpoint_resumes_here_under_tp2_pp2(megatron_lm_run, tmp_path):
    uninterrupted, save = megatron_lm_run
    load = checkpoint_at(save, SAVE_AT, tmp_path / "ckpt")
    job = ours(*TP2_PP2, "--load", str(load), nproc=4)
    assert f"at iteration {SAVE_AT} (written by Megatron-LM): {SAVE_AT * SAMPLES_PER_STEP} samples consumed" in (
        job.stdout
    )
    assert_resumed(iterations(job), uninterrupted, first_loss_pair_averaged=False)


def test_megatron_fsdp_checkpoints_move_both_ways_under_other_dp_sizes(megatron_lm, tmp_path):
    """Megatron-FSDP's ``fsdp_dtensor``: this trainer (DP2) saves at 3; Megatron-LM resumes that on one
    rank and saves at 5 (its common fields inside the DCP state, no common.pt, no ``_extra_state``);
    this trainer resumes Megatron-LM's on two ranks: every resumed iteration is the uninterrupted run's."""
    save, theirs = tmp_path / "ours", tmp_path / "theirs"
    uninterrupted = iterations(ours(*MEGATRON_FSDP, "--save", str(save), "--save-interval", str(SAVE_AT), nproc=2))
    load = checkpoint_at(save, SAVE_AT, tmp_path / "at3")
    flags = ("--load", str(load), "--save", str(theirs), "--save-interval", "5")
    job = upstream(megatron_lm, *MODEL, *MEGATRON_FSDP, *flags, nproc=1).check()
    assert_resumed(iterations(job), uninterrupted, first_loss_pair_averaged=True)
    back = iterations(ours(*MEGATRON_FSDP, "--load", str(checkpoint_at(theirs, 5, tmp_path / "at5")), nproc=2))
    assert sorted(back) == [6] and back[6][0] == uninterrupted[6][0] == 6 * SAMPLES_PER_STEP
    assert back[6][1] == pytest.approx(uninterrupted[6][1], rel=1e-5)


def test_under_the_same_layout_the_rng_states_carry_over(megatron_lm_run, tmp_path):
    """One rank here, resumed from Megatron-LM's iteration-3 checkpoint under another --seed: the RNG
    states this trainer saves at 6 are Megatron-LM's own at 6, in its keys. Nothing draws from them
    without dropout (Megatron-LM's states at 3 and 6 are equal), so they are the ones loaded: this
    run's seed would have given others. (The seed also orders the dataset: the losses differ.)"""
    uninterrupted, save = megatron_lm_run
    load = checkpoint_at(save, SAVE_AT, tmp_path / "ckpt")
    flags = ("--load", str(load), "--save", str(load), "--save-interval", str(SAVE_AT), "--seed", "4321")
    resumed = iterations(ours(*flags, nproc=1))
    assert {i: samples for i, (samples, _) in resumed.items()} == {i: uninterrupted[i][0] for i in RESUMED}
    theirs, mine = (_rng_states(root / "iter_0000006", tmp_path / name) for root, name in ((save, "u"), (load, "r")))
    assert set(mine[0]) == {
        "random_rng_state",
        "np_rng_state",
        "torch_rng_state",
        "cuda_rng_state",
        "rng_tracker_states",
    }
    _assert_same(mine, theirs)


def _rng_states(checkpoint: Path, scratch: Path) -> list[dict]:
    """The one-rank checkpoint's saved RNG entries (a list: one per DP rank under
    --data-parallel-random-init), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, scratch)
    [states] = [v for k, v in torch.load(scratch, weights_only=False).items() if k.startswith("rng_state/")]
    return states[0]  # the ShardedObject's data, as saved


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    elif hasattr(a, "shape"):  # numpy's state array
        assert (a == b).all()
    else:
        assert a == b


def _convert_machinery():
    """tests/convert/test_convert.py's small HF models, printed-flag reader and identical-document
    dataset (every sample the document plus its first token, whatever the shuffle)."""
    import importlib.util

    pytest.importorskip("transformers")
    if "test_convert" not in sys.modules:
        spec = importlib.util.spec_from_file_location("test_convert", ROOT / "tests/convert/test_convert.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["test_convert"] = module
        spec.loader.exec_module(module)
    return sys.modules["test_convert"]


def test_a_converted_hf_model_gives_its_loss_in_megatron_lm(megatron_lm, tmp_path):
    """`megatron-npu convert to-megatron`'s checkpoint, loaded by Megatron-LM's pretrain_gpt.py with
    the flags the converter printed: its first loss is the HF model's on the same sample (as this
    trainer's is: tests/convert/test_convert.py)."""
    convert = _convert_machinery()
    model = convert._random_model("llama")  # GQA, llama3 RoPE scaling, untied output layer
    model.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        hf_loss = convert._loss(model(convert.SAMPLE[None, :-1]).logits[0])
    cli = ["-m", "megatron_npu.cli", "convert", "to-megatron", str(tmp_path / "hf"), str(tmp_path / "megatron")]
    printed = run([sys.executable, *cli]).check().stdout
    convert._identical_documents(tmp_path / "docs", convert.DOCUMENT, 64)
    flags = [
        *convert.printed_command(printed),
        *["--data-path", str(tmp_path / "docs"), "--split", "100,0,0", "--eval-iters", "0", "--eval-interval", "1000"],
        *["--tokenizer-type", "NullTokenizer", "--vocab-size", str(convert.VOCAB - 1)],  # NullTokenizer adds its EOD
        *NO_DROPOUT,
        *["--seq-length", str(convert.SEQ), "--micro-batch-size", "1", "--global-batch-size", "1"],
        *["--train-iters", "1", "--lr", "1e-4", "--log-interval", "1"],
    ]
    job = upstream(megatron_lm, *flags, nproc=1).check()
    assert iterations(job)[1][1] == pytest.approx(hf_loss, rel=1e-4)
