"""Context parallelism in pretrain_gpt.py: per-iteration lm loss equal to CP1's (rel 1e-5).

The small GPT of tests/pretrain_runs.py (seq 32, 4 layers, 4 heads), no dropout, 6 iterations.
CP does not change the initial weights (megatron seeds by TP, PP and EP rank) nor the global
batches, so CP-only layouts compare from scratch; layouts with TP, PP or EP start from CP1's
checkpoint at iteration 2 (each TP shard, stage and expert rank draws its own weights). Launches:

  cp1          1 rank, saves at 2, 4, 6: the reference
  cp2          CP2 ring (p2p), 2 ranks, from scratch; saves at 3, 6
  cp2_resumed  CP2 from cp2's iteration 3: bit-exact
  cp1_from_cp2 1 rank from cp2's iteration 3 (a CP checkpoint loads under any CP)
  cp4          CP4 a2a+p2p (hierarchical 2 x 2), 4 ranks, from scratch
  a2a_pp2      CP2 all-to-all x PP2, 4 ranks, from cp1's iteration 2
  tp2_sp       TP2 x CP2 with sequence parallelism, one comm type per layer (p2p a2a p2p a2a), 4 ranks,
               from cp1's iteration 2
  moe1, moe_ep2  MoE at CP1 (saves at 2), then CP2 x EP2 (2 ranks) from its iteration 2

Bad CP layouts stop start-up with one line before any process group (in-process, as
tests/training/test_pretrain_errors.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pretrain_runs import MOCK_DATA, MODEL, NO_DROPOUT, checkpoint_at, pretrain, train_losses

RUN = ["--train-iters", "6", "--eval-interval", "1000", *NO_DROPOUT]
MOE = ["--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
REL = 1e-5


def run(tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str, nproc: int, load: Path | None = None) -> Path:
    """One launch; returns its run directory (losses in logs/metrics.jsonl, checkpoints in ckpt/)."""
    where = tmp_path_factory.mktemp(name)
    loading = ("--load", str(load)) if load is not None else ()
    saving = ("--save", str(where / "ckpt")) if "--save-interval" in flags else ()
    # a generous limit: a launch waits on its ranks, never on a clock, unless it hangs
    pretrain(where, *RUN, *saving, *loading, *flags, nproc=nproc, timeout=1800).check()
    return where


def from_checkpoint(tmp_path_factory: pytest.TempPathFactory, source: Path, iteration: int) -> Path:
    return checkpoint_at(source / "ckpt", iteration, tmp_path_factory.mktemp("load") / "ckpt")


def assert_same_losses(actual: dict[int, float], expected: dict[int, float], iterations: range) -> None:
    assert set(iterations) <= set(actual), actual
    for i in iterations:
        assert abs(actual[i] - expected[i]) <= REL * abs(expected[i]), (i, actual[i], expected[i])


@pytest.fixture(scope="module")
def cp1(tmp_path_factory) -> Path:
    return run(tmp_path_factory, "cp1", "--save-interval", "2", nproc=1)


@pytest.fixture(scope="module")
def cp2(tmp_path_factory) -> Path:
    return run(tmp_path_factory, "cp2", "--context-parallel-size", "2", "--save-interval", "3", nproc=2)


@pytest.mark.launch
def test_cp2_ring_and_cp4_hierarchical_train_with_the_losses_of_cp1_from_scratch(cp1, cp2, tmp_path_factory):
    reference = train_losses(cp1)
    assert_same_losses(train_losses(cp2), reference, range(1, 7))
    hierarchical = ("--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2")
    cp4 = run(tmp_path_factory, "cp4", "--context-parallel-size", "4", *hierarchical, nproc=4)
    assert_same_losses(train_losses(cp4), reference, range(1, 7))


@pytest.mark.launch
def test_cp2_checkpoint_resumes_exactly_and_trains_on_under_cp1(cp2, tmp_path_factory):
    uninterrupted = train_losses(cp2)
    load = from_checkpoint(tmp_path_factory, cp2, 3)
    resumed = run(tmp_path_factory, "cp2_resumed", "--context-parallel-size", "2", nproc=2, load=load)
    assert {i: train_losses(resumed)[i] for i in (4, 5, 6)} == {i: uninterrupted[i] for i in (4, 5, 6)}
    under_cp1 = run(tmp_path_factory, "cp1_from_cp2", nproc=1, load=from_checkpoint(tmp_path_factory, cp2, 3))
    assert_same_losses(train_losses(under_cp1), uninterrupted, range(4, 7))


@pytest.mark.launch
def test_cp2_with_pipeline_and_with_tensor_parallel_sequence_parallel_equal_cp1(cp1, tmp_path_factory):
    reference = train_losses(cp1)
    a2a_pp2 = run(
        tmp_path_factory,
        "a2a_pp2",
        *("--context-parallel-size", "2", "--cp-comm-type", "a2a", "--pipeline-model-parallel-size", "2"),
        nproc=4,
        load=from_checkpoint(tmp_path_factory, cp1, 2),
    )
    assert_same_losses(train_losses(a2a_pp2), reference, range(3, 7))
    tp2_sp = run(
        tmp_path_factory,
        "tp2_sp",
        *("--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"),
        *("--cp-comm-type", "p2p", "a2a", "p2p", "a2a"),
        nproc=4,
        load=from_checkpoint(tmp_path_factory, cp1, 2),
    )
    assert_same_losses(train_losses(tp2_sp), reference, range(3, 7))


@pytest.mark.launch
def test_cp2_with_expert_parallel_moe_equals_cp1(tmp_path_factory):
    moe1 = run(tmp_path_factory, "moe1", *MOE, "--save-interval", "2", nproc=1)
    ep2 = run(
        tmp_path_factory,
        "moe_ep2",
        *MOE,
        *("--context-parallel-size", "2", "--expert-model-parallel-size", "2"),
        *("--moe-token-dispatcher-type", "alltoall"),
        nproc=2,
        load=from_checkpoint(tmp_path_factory, moe1, 2),
    )
    assert_same_losses(train_losses(ep2), train_losses(moe1), range(3, 7))


BAD_LAYOUTS = {
    "sequence": (
        ["--context-parallel-size", "4", "--seq-length", "20", "--max-position-embeddings", "20"],
        "--seq-length 20 is not divisible by 2 x --context-parallel-size 4 = 8",
    ),
    "heads": (
        ["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-query-groups", "2", "--group-query-attention"],
        "--cp-comm-type a2a: the all-to-all over 4 ranks splits each TP rank's attention heads (4) and query groups (2)",
    ),
    "hierarchical": (
        [
            "--context-parallel-size",
            "4",
            "--cp-comm-type",
            "a2a+p2p",
            "--hierarchical-context-parallel-sizes",
            "2",
            "4",
        ],
        "--hierarchical-context-parallel-sizes 2 4 must be two sizes (a2a, p2p) whose product is --context-parallel-size 4",
    ),
    "dropout": (["--context-parallel-size", "2", "--attention-dropout", "0.1"], "set --attention-dropout 0"),
}


@pytest.mark.parametrize("name", sorted(BAD_LAYOUTS))
def test_bad_context_parallel_layouts_stop_start_up_with_one_line(name, monkeypatch, capsys):
    import torch.distributed as dist

    import pretrain_gpt

    flags, message = BAD_LAYOUTS[name]
    cp = int(flags[1])
    monkeypatch.setenv("WORLD_SIZE", str(cp))
    for rank in range(cp):  # every rank decides alone, before any process group
        monkeypatch.setenv("RANK", str(rank))
        argv = [*MODEL, *MOCK_DATA, "--train-iters", "3", *NO_DROPOUT, *flags]
        status = pretrain_gpt.pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            None,
            pretrain_gpt.forward_step,
            argv=argv,
        )
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megatron-npu: error:")]
        assert status == 2 and not dist.is_initialized()
        # every rank stops with status 2; the message is said once (rank 0; torchrun's error file otherwise)
        if rank == 0:
            assert len(lines) == 1 and message in lines[0], lines
        else:
            assert lines == []
