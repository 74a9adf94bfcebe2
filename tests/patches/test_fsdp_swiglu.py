"""megatron_npu/patches/fsdp.py, ``handle_swiglu_in_state_dict``: a SwiGLU model under Megatron-FSDP (optim_grads_params,
``fsdp_dtensor``) saves and resumes in both trainers, each at another DP size than the one that saved. Without the
patch every such save raised (Megatron-LM: "GPTModel has no attribute `module`", this trainer: "MegatronFSDP has no
attribute `decoder`"; NVIDIA/Megatron-LM issue #5265). Three launches: Megatron-LM DP2 saves at 2 and runs on to 4;
this trainer resumes that on one rank and saves at 3; Megatron-LM resumes this trainer's on two ranks."""

from __future__ import annotations

import pytest
import torch
from distributed import ROOT, Job, base_env, torchrun
from megatron_lm_checkout import LOSS_LINE, NEEDS_EXTRACT, upstream
from pretrain_runs import MOCK_DATA, NO_DROPOUT, checkpoint_at
from pretrain_runs import MODEL as PROJECT_MODEL

import megatron_npu  # noqa: F401  (patches on import)
from megatron_npu.patches.fsdp import ParametersByName

MODEL = [*PROJECT_MODEL, "--eval-interval", "1000", *NO_DROPOUT, *MOCK_DATA, "--train-iters", "4", "--swiglu"]
MEGATRON_FSDP = [
    *("--use-megatron-fsdp", "--use-distributed-optimizer", "--untie-embeddings-and-output-weights"),
    *("--data-parallel-sharding-strategy", "optim_grads_params", "--ckpt-format", "fsdp_dtensor"),
]


def losses(job: Job) -> dict[int, float]:
    found = {int(m[1]): float(m[2]) for m in map(LOSS_LINE.search, job.stdout.splitlines()) if m}
    assert found, f"no iteration lines\n{job.stdout[-3000:]}\n{job.stderr[-3000:]}"
    return found


def test_parameters_are_found_by_either_name():
    """The lookup megatron-core's function makes, on a model wrapped twice (FullyShardedDataParallel, MegatronFSDP)."""

    class Wrapper(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    inner = torch.nn.Sequential(torch.nn.Linear(2, 2))
    inner.config = object()
    model = ParametersByName(Wrapper(Wrapper(inner)))
    assert model.get_parameter("module.0.weight") is inner[0].weight  # the model state's module.{key}
    assert model.get_parameter("0.weight") is inner[0].weight  # the optimizer state's key, module. cut off
    assert model.config is inner.config


UPSTREAM = NEEDS_EXTRACT


@pytest.fixture(scope="module")
def resumes(megatron_lm, tmp_path_factory) -> dict[str, dict[int, float]]:
    """Megatron-LM on two ranks (4 iterations, saving at 2); this trainer resuming its iteration 2 on one rank (saving
    at 3); Megatron-LM resuming this trainer's iteration 3 on two ranks: the losses each logged."""
    root = tmp_path_factory.mktemp("fsdp-swiglu")
    theirs, ours = root / "theirs", root / "ours"
    save = ("--save", str(theirs), "--save-interval", "2")
    runs = {"uninterrupted": losses(upstream(megatron_lm, *MODEL, *MEGATRON_FSDP, *save, nproc=2).check())}
    flags = ("--load", str(checkpoint_at(theirs, 2, root / "at2")), "--save", str(ours), "--save-interval", "3")
    job = torchrun(ROOT / "pretrain_gpt.py", *MODEL, *MEGATRON_FSDP, *flags, nproc=1, env=base_env())
    runs["ours"] = losses(job.check())
    back = checkpoint_at(ours, 3, root / "at3")
    runs["back"] = losses(upstream(megatron_lm, *MODEL, *MEGATRON_FSDP, "--load", str(back), nproc=2).check())
    return runs


@pytest.mark.launch
@UPSTREAM
def test_megatron_lm_saves_and_this_trainer_resumes_at_another_dp_size(resumes):
    """The first resumed iteration runs the saved weights (Megatron-LM DP2 -> this trainer DP1)."""
    assert sorted(resumes["uninterrupted"]) == [1, 2, 3, 4] and sorted(resumes["ours"]) == [3, 4]
    assert resumes["ours"][3] == pytest.approx(resumes["uninterrupted"][3], rel=1e-5)


@pytest.mark.launch
@UPSTREAM
def test_this_trainer_saves_and_megatron_lm_resumes_at_another_dp_size(resumes):
    """This trainer's iteration-3 checkpoint (DP1: weights and optimizer state) resumed by Megatron-LM on two ranks
    logs this trainer's own iteration 4."""
    assert resumes["back"] == {4: pytest.approx(resumes["ours"][4], rel=1e-5)}


@pytest.mark.launch
@UPSTREAM
def test_this_trainer_resumes_the_optimizer_state_of_a_swiglu_model(resumes):
    assert resumes["ours"][4] == pytest.approx(resumes["uninterrupted"][4], rel=1e-5)
