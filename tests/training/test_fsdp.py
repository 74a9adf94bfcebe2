"""FSDP in pretrain_gpt.py (megatron_npu/training/fsdp.py, fsdp_args.py) on the cpu target, fp32.

Megatron-FSDP (``optim_grads_params``) on 2 ranks, CP2 x DP2 Megatron-FSDP (``optim``, sharded over DP x CP)
and TP2 x Megatron-FSDP (``optim_grads``) on 4 ranks, Megatron-FSDP ``no_shard`` and torch FSDP2 on 2 ranks
train the 1-rank run's model with its per-iteration losses (rel 1e-5); MoE with EP2 x Megatron-FSDP
(``optim_grads_params``: dense weights sharded over DP 4, experts over expert DP 2) trains on from a 1-rank
checkpoint with the 1-rank losses. A Megatron-FSDP ``fsdp_dtensor`` checkpoint resumes exactly under the
DP size that saved it, and trains on under another TP and DP size (TP2 x DP2 -> 1 rank) and EP size
(EP1 -> EP2) with the 1-rank run's losses. Bad combinations stop before any process group: checked in this
process (fast), and once through torchrun (every rank exits).

Launches (each a module-scoped run read by several tests, or one test's): the 1-rank reference, Megatron-FSDP
on 2 ranks (saving), its resume on 2 ranks, TP2 x Megatron-FSDP on 4 ranks (saving), a 1-rank resume of its
checkpoint, CP2 x DP2 on 4 ranks, no_shard on 2 ranks, MoE on 1 rank (saving) and EP2 on 4 ranks from it,
FSDP2 on 2 ranks (saving), its resume on 2 ranks and on 1 rank, one bad start.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import torchrun
from pretrain_runs import MOCK_DATA, MODEL, NO_DROPOUT, PRETRAIN, checkpoint_at, pretrain, train_losses

from megatron_npu.policy import ConfigError
from megatron_npu.training.arguments import parse_args

# every run trains one model: untied embeddings (FSDP2 requires them), weights initialised whole on
# the host and then split (so TP2's shards are TP1's weights)
COMMON = [
    *("--train-iters", "4", "--eval-interval", "1000"),
    "--untie-embeddings-and-output-weights",
    "--use-cpu-initialization",
    *NO_DROPOUT,
]
MEGATRON_FSDP = [
    "--use-megatron-fsdp",
    *("--data-parallel-sharding-strategy", "optim_grads_params"),
    "--use-distributed-optimizer",
    *("--ckpt-format", "fsdp_dtensor"),
]
TORCH_FSDP2 = ["--use-torch-fsdp2"]
# a small MoE: 4 experts, top-2, dropless, every layer MoE; EP2 on 4 ranks is expert DP 2 beside dense DP 4
MOE = [
    *("--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"),
    *("--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"),
]
EP2 = ["--expert-model-parallel-size", "2"]
# later flags win: the other strategies (no_shard without --overlap-param-gather: megatron_npu/patches/fsdp.py)
OPTIM_GRADS = ["--data-parallel-sharding-strategy", "optim_grads"]
OPTIM = ["--data-parallel-sharding-strategy", "optim"]
NO_SHARD = ["--data-parallel-sharding-strategy", "no_shard"]
ITERATIONS = [1, 2, 3, 4]


def _run(tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str, nproc: int) -> Path:
    """One launch; ``{run}`` in a flag is the run's directory."""
    run_dir = tmp_path_factory.mktemp(name)
    job = pretrain(run_dir, *COMMON, *(flag.format(run=run_dir) for flag in flags), nproc=nproc).check()
    assert "Traceback" not in job.stderr, job.stderr[-3000:]
    return run_dir


def _assert_same_losses(got: dict[int, float], expected: dict[int, float], iterations: list[int], rel: float) -> None:
    assert sorted(got) == iterations, got
    for iteration in iterations:
        assert got[iteration] == pytest.approx(expected[iteration], rel=rel, abs=0), iteration


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The plain trainer on one rank (megatron-core's DDP, no FSDP)."""
    losses = train_losses(_run(tmp_path_factory, "reference", nproc=1))
    assert sorted(losses) == ITERATIONS and losses[4] < losses[1], losses
    return losses


@pytest.fixture(scope="module")
def torch_fsdp2_2(tmp_path_factory) -> Path:
    return _run(tmp_path_factory, "fsdp2_2", *TORCH_FSDP2, "--save-interval", "2", "--save", "{run}/ckpt", nproc=2)


@pytest.fixture(scope="module")
def megatron_fsdp_2(tmp_path_factory) -> Path:
    return _run(tmp_path_factory, "mfsdp2", *MEGATRON_FSDP, "--save-interval", "2", "--save", "{run}/ckpt", nproc=2)


@pytest.fixture(scope="module")
def megatron_fsdp_tp2(tmp_path_factory) -> Path:
    """TP2 x Megatron-FSDP optim_grads (DP2) on 4 ranks, saving at 2 and 4."""
    tp2 = ["--tensor-model-parallel-size", "2", *OPTIM_GRADS]
    return _run(
        tmp_path_factory, "mfsdp_tp2", *MEGATRON_FSDP, *tp2, "--save-interval", "2", "--save", "{run}/ckpt", nproc=4
    )


# ---- loss equality -----------------------------------------------------------------------------
@pytest.mark.launch
@pytest.mark.parametrize(
    ("name", "flags", "nproc"),
    [
        # sharded over DP x CP (4 ranks); optim_grads_params on 4 ranks: the EP test's dense weights (DP 4)
        ("cp2_megatron_fsdp_optim_dp2", [*MEGATRON_FSDP, "--context-parallel-size", "2", *OPTIM], 4),
        ("megatron_fsdp_no_shard_dp2", [*MEGATRON_FSDP, *NO_SHARD], 2),
    ],
)
def test_fsdp_trains_the_one_rank_losses(reference, tmp_path_factory, name, flags, nproc):
    _assert_same_losses(train_losses(_run(tmp_path_factory, name, *flags, nproc=nproc)), reference, ITERATIONS, 1e-5)


@pytest.mark.launch
def test_tp2_x_megatron_fsdp_trains_the_one_rank_losses(reference, megatron_fsdp_tp2):
    _assert_same_losses(train_losses(megatron_fsdp_tp2), reference, ITERATIONS, 1e-5)


@pytest.mark.launch
def test_megatron_fsdp_on_two_ranks_trains_the_one_rank_losses(reference, megatron_fsdp_2):
    _assert_same_losses(train_losses(megatron_fsdp_2), reference, ITERATIONS, 1e-5)
    saved = sorted(p.name for p in (megatron_fsdp_2 / "ckpt").iterdir())
    # published atomically: no .partial left, the tracker names the last
    assert saved == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"], saved
    assert (megatron_fsdp_2 / "ckpt" / "iter_0000002" / ".metadata").is_file()  # torch.distributed.checkpoint's


# ---- checkpoints -------------------------------------------------------------------------------
def _resume(tmp_path_factory, name: str, saved_run: Path, nproc: int) -> Path:
    """Megatron-FSDP resuming ``saved_run``'s iteration 2 (a root holding only it) and training to 4."""
    root = checkpoint_at(saved_run / "ckpt", 2, tmp_path_factory.mktemp(f"{name}_root"))
    return _run(tmp_path_factory, name, *MEGATRON_FSDP, "--load", str(root), nproc=nproc)


@pytest.mark.launch
def test_a_megatron_fsdp_checkpoint_resumes_exactly(megatron_fsdp_2, tmp_path_factory):
    """Same DP size: model shards, optimizer state, scheduler, RNG and data position restored, the
    same arithmetic: the losses of iterations 3 and 4 are the uninterrupted run's, bit for bit."""
    resumed = _resume(tmp_path_factory, "mfsdp2_resumed", megatron_fsdp_2, nproc=2)
    _assert_same_losses(train_losses(resumed), train_losses(megatron_fsdp_2), [3, 4], rel=0)


@pytest.mark.launch
def test_a_megatron_fsdp_checkpoint_trains_on_under_another_tp_and_dp_size(
    reference, megatron_fsdp_tp2, tmp_path_factory
):
    """Saved by TP2 x DP2 (optim_grads), loaded by 1 rank (optim_grads_params): the DTensors hold each TP
    shard's place in the whole weight, so torch.distributed.checkpoint reshards across TP and DP (and
    across strategies): the 1-rank run's losses at iterations 3 and 4. (DP 1 -> 4: the EP test.)"""
    resumed = _resume(tmp_path_factory, "mfsdp1_from_tp2", megatron_fsdp_tp2, nproc=1)
    _assert_same_losses(train_losses(resumed), reference, [3, 4], rel=1e-5)


@pytest.mark.launch
def test_megatron_fsdp_with_expert_parallelism_trains_the_one_rank_losses(tmp_path_factory):
    """MoE under Megatron-FSDP: 1 rank saves at iteration 2; EP2 on 4 ranks (dense weights sharded over
    DP 4, each EP rank's experts over expert DP 2) trains on from it with the 1-rank run's losses. From a
    common checkpoint: each EP rank draws its own experts from scratch (tests/training/test_moe.py). The
    fsdp_dtensor files name experts by their global index, so the EP1 checkpoint loads under EP2."""
    one_rank = _run(
        tmp_path_factory, "moe_mfsdp1", *MOE, *MEGATRON_FSDP, "--save-interval", "2", "--save", "{run}/ckpt", nproc=1
    )
    root = checkpoint_at(one_rank / "ckpt", 2, tmp_path_factory.mktemp("moe_root"))
    ep2 = _run(tmp_path_factory, "moe_mfsdp_ep2", *MOE, *MEGATRON_FSDP, *EP2, "--load", str(root), nproc=4)
    _assert_same_losses(train_losses(ep2), train_losses(one_rank), [3, 4], rel=1e-5)


@pytest.mark.launch
def test_torch_fsdp2_trains_the_one_rank_losses_and_resumes_exactly_under_any_dp(
    reference, torch_fsdp2_2, tmp_path_factory
):
    """FSDP2 saves torch_dist (megatron-core's optimizer finds its DTensor parameters through
    megatron_npu/patches/fsdp.py; the loaded optimizer state becomes DTensors again): 2 ranks resume their own
    iteration-2 checkpoint bit for bit, 1 rank trains on from it with the 1-rank losses."""
    _assert_same_losses(train_losses(torch_fsdp2_2), reference, ITERATIONS, 1e-5)
    root = checkpoint_at(torch_fsdp2_2 / "ckpt", 2, tmp_path_factory.mktemp("fsdp2_root"))
    resumed = _run(tmp_path_factory, "fsdp2_resumed", *TORCH_FSDP2, "--load", str(root), nproc=2)
    _assert_same_losses(train_losses(resumed), train_losses(torch_fsdp2_2), [3, 4], rel=0)
    one_rank = _run(tmp_path_factory, "fsdp2_1_from_2", *TORCH_FSDP2, "--load", str(root), nproc=1)
    _assert_same_losses(train_losses(one_rank), reference, [3, 4], rel=1e-5)


# ---- bad combinations --------------------------------------------------------------------------
BASE = [*MODEL, *MOCK_DATA, *COMMON]
BAD = {
    "both implementations": ([*MEGATRON_FSDP, *TORCH_FSDP2], 2, "--use-megatron-fsdp and --use-torch-fsdp2"),
    "fsdp2 with pipeline stages": (
        [*TORCH_FSDP2, "--pipeline-model-parallel-size", "2"],
        2,
        "--use-torch-fsdp2 is not supported with pipeline parallelism",
    ),
    "fsdp2 with experts": (
        [*TORCH_FSDP2, "--num-experts", "2", "--expert-model-parallel-size", "2", "--disable-bias-linear"],
        2,
        "--use-torch-fsdp2 is not supported with expert parallelism",
    ),
    "fsdp2 with the distributed optimizer": (
        [*TORCH_FSDP2, "--use-distributed-optimizer"],
        2,
        "--use-torch-fsdp2 is not supported with megatron-core's distributed optimizer",
    ),
    "fsdp2 with tied embeddings": (
        ["--use-torch-fsdp2", "--num-layers", "4"],  # COMMON unties: the case drops it below
        2,
        "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights",
    ),
    "fsdp2 with fsdp_dtensor": (
        [*TORCH_FSDP2, "--ckpt-format", "fsdp_dtensor"],
        2,
        "--ckpt-format fsdp_dtensor is Megatron-FSDP's checkpoint format",
    ),
    "megatron-fsdp saving torch_dist": (
        ["--use-megatron-fsdp", "--use-distributed-optimizer"],
        2,
        "--use-megatron-fsdp saves only --ckpt-format fsdp_dtensor",
    ),
    "megatron-fsdp without the distributed optimizer": (
        ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"],
        2,
        "--use-megatron-fsdp shards the optimizer state through megatron-core's distributed optimizer",
    ),
    "megatron-fsdp with pipeline stages": (
        [*MEGATRON_FSDP, "--pipeline-model-parallel-size", "2"],
        2,
        "--use-megatron-fsdp is not supported with pipeline parallelism",
    ),
    "the removed alias": (["--use-custom-fsdp"], 2, "--use-custom-fsdp is not supported"),
    "hybrid sharding": ([*MEGATRON_FSDP, "--outer-dp-sharding-strategy", "optim"], 2, "--outer-dp-sharding-strategy"),
    "an unknown strategy": (
        ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "full"],
        2,
        "--data-parallel-sharding-strategy",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_fsdp_combination_is_one_line_naming_the_flag(case):
    flags, world_size, message = BAD[case]
    argv = [*BASE, *flags]
    if case == "fsdp2 with tied embeddings":
        argv.remove("--untie-embeddings-and-output-weights")
    with pytest.raises(ConfigError) as error:
        parse_args(argv, world_size=world_size, check_paths=False)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize(
    ("strategy", "fsdp_flags"),
    [(s, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", s]) for s in ("no_shard", "optim", "optim_grads")]
    + [("optim_grads_params", MEGATRON_FSDP[:-2])],
)
def test_megatron_fsdp_flags_as_megatron_lm_defines_them(strategy, fsdp_flags):
    args = parse_args(
        [*BASE, *fsdp_flags, "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"],
        world_size=2,
        check_paths=False,
    )
    assert args.data_parallel_sharding_strategy == strategy and args.use_custom_fsdp  # megatron-core's old name
    assert args.gradient_reduce_div_fusion and args.suggested_communication_unit_size is None
    plain = parse_args(BASE, world_size=1, check_paths=False)
    assert plain.data_parallel_sharding_strategy == "no_shard" and not plain.use_megatron_fsdp
    assert not plain.use_torch_fsdp2 and plain.torch_fsdp2_reshard_after_forward


def test_megatron_fsdp_takes_expert_and_context_parallelism_and_refuses_pipeline_stages():
    """megatron-core 0.16.1's adapter builds an expert mesh (expert DP x expert TP) and shards over DP x CP;
    its dense mesh spans DP x TP of the whole world, so pipeline stages fail there (the refusal says so)."""
    for layout, dp in (([*MOE, *EP2], 4), (["--context-parallel-size", "2"], 2)):  # EP2: dense DP 4
        args = parse_args([*BASE, *MEGATRON_FSDP, *layout], world_size=4, check_paths=False)
        assert args.use_megatron_fsdp and args.data_parallel_size == dp
    with pytest.raises(ConfigError, match="device mesh over DP x TP of the whole world"):
        parse_args([*BASE, *MEGATRON_FSDP, "--pipeline-model-parallel-size", "2"], world_size=4, check_paths=False)


@pytest.mark.launch
def test_every_rank_stops_at_start_up_on_a_bad_fsdp_combination():
    job = torchrun(PRETRAIN, *BASE, *TORCH_FSDP2, "--use-distributed-optimizer", nproc=2, timeout=600)
    assert job.returncode != 0
    assert job.stderr.count("megatron-npu: error: --use-torch-fsdp2 is not supported with megatron-core's") == 1
    assert "[rank0]: Traceback" not in job.stderr and "[rank1]: Traceback" not in job.stderr
