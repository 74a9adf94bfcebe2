"""A GPU-written megatron-core script trains on the cpu target with only `import megatron_npu`.

Three torchrun launches (megatron-core import dominates): the TP1 reference, TP2xPP2,
and TP1xPP2xDP2 with the distributed optimizer; all with tied embeddings across the
pipeline, the same initial weights (re-sharded) and the same global batches.
"""

import pytest
from distributed import ROOT, torchrun

pytestmark = pytest.mark.launch  # every test here starts processes

WORKER = ROOT / "tests" / "fixtures" / "gpu_style_gpt.py"
STEPS = "4"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    weights = tmp_path_factory.mktemp("init") / "weights.pt"
    reference = torchrun(WORKER, "--tied", "--steps", STEPS, "--save-init", str(weights), nproc=1).check()
    common = ("--tied", "--steps", STEPS, "--init-from", str(weights), "--rng-probe")
    tp2pp2 = torchrun(WORKER, "--tp", "2", "--pp", "2", *common, nproc=4).check()
    dp2_distopt = torchrun(WORKER, "--pp", "2", "--dist-opt", *common, nproc=4).check()
    return reference.by_rank(), tp2pp2.by_rank(), dp2_distopt.by_rank()


def last_stage_losses(results):
    losses = [r["losses"] for r in results.values() if r["losses"]]
    assert losses, "no rank reported losses"
    return losses[0]


def assert_close(actual, expected, rel=1e-5):
    assert len(actual) == len(expected) == int(STEPS)
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert abs(a - e) <= rel * abs(e), f"step {step}: {a} vs {e}"


def test_every_rank_ran_on_gloo_although_the_script_asked_for_nccl(runs):
    for results in runs:
        assert {r["backend"] for r in results.values()} == {"gloo"}


def test_tp2_pp2_matches_tp1_per_step(runs):
    reference, tp2pp2, _ = runs
    assert len(tp2pp2) == 4
    assert_close(last_stage_losses(tp2pp2), last_stage_losses(reference))


def test_pp2_dp2_with_distributed_optimizer_matches_tp1_per_step(runs):
    reference, _, dp2 = runs
    assert {r["dp_rank"] for r in dp2.values()} == {0, 1}
    assert_close(last_stage_losses(dp2), last_stage_losses(reference))


def test_losses_change_between_steps(runs):
    losses = last_stage_losses(runs[0])
    assert len(set(losses)) == len(losses), "training did not move the loss"


def test_tracker_gives_different_dropout_on_different_tp_ranks(runs):
    _, tp2pp2, _ = runs
    for pp_rank in (0, 1):
        masks = {r["tp_rank"]: r["rng"]["inside"] for r in tp2pp2.values() if r["pp_rank"] == pp_rank}
        assert masks[0] != masks[1]


def test_tracker_gives_the_same_dropout_on_the_same_tp_rank_of_different_dp_ranks(runs):
    _, _, dp2 = runs
    for pp_rank in (0, 1):
        masks = [r["rng"]["inside"] for r in dp2.values() if r["pp_rank"] == pp_rank]
        assert len(masks) == 2 and masks[0] == masks[1]


def test_fork_switches_between_the_default_and_the_tracker_stream(runs):
    for results in runs[1:]:
        for result in results.values():
            rng = result["rng"]
            assert rng["inside"] != rng["outside"]
            # the tracker's state advanced inside the first fork and was kept
            assert rng["inside_again"] != rng["inside"]
