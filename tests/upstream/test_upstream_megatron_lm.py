"""Megatron-LM core_v0.16.1's own training stack, unmodified, on the patch layer (cpu target).

The extract of Megatron-LM (megatron/training, pretrain_gpt.py, examples/) is unpacked into
a temporary directory and put on PYTHONPATH, where it merges with the megatron-core wheel as
in a user's checkout; its scripts run through ``python -m megatron_npu.run`` under torchrun.

Layouts are compared from one TP1 checkpoint: Megatron-LM initialises each pipeline stage
from its own seed (seed + 100 * pp_rank) and each TP shard from its rank's RNG, so runs
started from scratch under different layouts start from different weights by design.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from distributed import ROOT, Job, base_env, run, torchrun
from megatron_lm_checkout import LOSS_LINE, NEEDS_EXTRACT, env_for, upstream
from pretrain_runs import MOCK_DATA, NO_DROPOUT
from pretrain_runs import MODEL as PROJECT_MODEL

pytestmark = [
    pytest.mark.launch,
    NEEDS_EXTRACT,
]

# tests/pretrain_runs.py's tiny GPT (4 layers: one per virtual stage under PP2 x VPP2; 8 samples per
# step = 4 micro-batches under DP1), no dropout so layouts compare exactly, no evaluation (argparse:
# the later --eval-interval wins, in Megatron-LM's parser as in ours).
MODEL = [
    *PROJECT_MODEL,
    "--eval-interval",
    "1000",
    *NO_DROPOUT,
    *MOCK_DATA,
    "--train-iters",
    "6",
    "--use-distributed-optimizer",
]
SAVE_AT = 3
RESUMED = (4, 5, 6)
GRAD_NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?grad norm: ([0-9.]+)")
UPSTREAM_NORMS: dict[str, dict[int, str]] = {}  # printed grad norms per run, filled by the fixtures


def losses(job: Job) -> dict[int, float]:
    found = {int(m.group(1)): float(m.group(2)) for m in map(LOSS_LINE.search, job.stdout.splitlines()) if m}
    assert found, f"no iteration lines\n{job.stdout[-3000:]}\n{job.stderr[-3000:]}"
    return found


def grad_norms(job: Job) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in map(GRAD_NORM.search, job.stdout.splitlines()) if m}


def checkpoint_at(source: Path, iteration: int, destination: Path) -> Path:
    destination.mkdir(parents=True)
    name = f"iter_{iteration:07d}"
    shutil.copytree(source / name, destination / name)
    (destination / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return destination


def assert_close(actual: dict[int, float], expected: dict[int, float], iterations: tuple[int, ...], rel: float) -> None:
    for iteration in iterations:
        assert abs(actual[iteration] - expected[iteration]) <= rel * abs(expected[iteration]), (
            iteration,
            actual[iteration],
            expected[iteration],
        )


@pytest.fixture(scope="session")
def tp1(megatron_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], Path]:
    """The reference: TP1, 6 iterations, a checkpoint every 3 that any layout can load."""
    save = tmp_path_factory.mktemp("tp1") / "ckpt"
    job = upstream(
        megatron_lm,
        *MODEL,
        "--save",
        str(save),
        "--save-interval",
        str(SAVE_AT),
        "--dist-ckpt-optim-fully-reshardable",
        nproc=1,
    ).check()
    UPSTREAM_NORMS["tp1"] = grad_norms(job)
    return losses(job), save


def resumed_under(
    megatron_lm: Path, tp1: tuple[dict[int, float], Path], where: Path, *flags: str, nproc: int, save: bool = False
) -> Job:
    load = checkpoint_at(tp1[1], SAVE_AT, where / "ckpt")
    extra = ("--save", str(load), "--save-interval", "3", "--dist-ckpt-optim-fully-reshardable") if save else ()
    return upstream(megatron_lm, *MODEL, "--load", str(load), *extra, *flags, nproc=nproc).check()


def test_tp1_trains_and_the_loss_falls(tp1):
    reference, save = tp1
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    assert reference[6] < reference[1]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


# Paths of Megatron-LM's loop that the math does not see, exercised by the resumed TP1 run: the
# signal handler gathers its flags every iteration on the device dist_signal_handler picks, and
# --profile (nsys: cudaProfilerStart, emit_nvtx) becomes torch's profiler. Megatron-LM's profiler
# schedule counts steps from the process start (a resumed run's first step is 0): start 1 records
# from the first resumed iteration, and the trace is written when iteration 5 stops it.
OBSERVERS = ("--exit-signal-handler", "--profile", "--profile-step-start", "1", "--profile-step-end", "5")
RESUMED_JOBS: dict[str, Job] = {}


@pytest.fixture(scope="session")
def tp1_resumed(megatron_lm, tp1, tmp_path_factory) -> tuple[dict[int, float], Path]:
    """TP1 again, resumed from the reference's iteration-3 checkpoint and saving at 6."""
    where = tmp_path_factory.mktemp("tp1-resumed")
    traces = ("--tensorboard-dir", str(where / "tensorboard"))
    job = resumed_under(megatron_lm, tp1, where, *OBSERVERS, *traces, nproc=1, save=True)
    RESUMED_JOBS["tp1"] = job
    return losses(job), where / "ckpt"


def test_profile_and_signal_handler_run_off_cuda(tp1_resumed):
    _, save = tp1_resumed
    job = RESUMED_JOBS["tp1"]
    assert "--profile uses nsys" in job.stdout + job.stderr  # one warning naming the switch
    assert list((save.parent / "tensorboard").glob("*.pt.trace.json")), "the profiler wrote its trace"


def test_resume_is_bit_exact(tp1, tp1_resumed, tmp_path):
    (reference, save), (resumed, resumed_save) = tp1, tp1_resumed
    assert sorted(resumed) == list(RESUMED)
    # Bit-exact: every tensor of the iteration-6 checkpoint (model, optimizer state, fp32 main
    # params) equals the uninterrupted run's. The files themselves differ (write order, args).
    mine, theirs = (
        _tensors(resumed_save / "iter_0000006", tmp_path / "r.pt"),
        _tensors(save / "iter_0000006", tmp_path / "u.pt"),
    )
    assert mine.keys() == theirs.keys() and len(mine) > 16
    assert [k for k in mine if not torch.equal(mine[k], theirs[k])] == []
    # The printed losses agree, but for one quirk of Megatron-LM's training_log: a process's second
    # logged lm loss is the mean of its first two iterations' (the accumulator is not reset after
    # the first log line). Resumed at 3, that is iteration 5 = mean(4, 5) of the uninterrupted run.
    assert resumed[4] == reference[4] and resumed[6] == reference[6]
    assert resumed[5] == pytest.approx((reference[4] + reference[5]) / 2, rel=1e-6)


def _tensors(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """A torch_dist checkpoint's tensors, read without any process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, scratch)
    return {k: v for k, v in torch.load(scratch, weights_only=False).items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize(
    ("layout", "nproc"),
    [
        (("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"), 4),
        (("--pipeline-model-parallel-size", "2"), 4),  # PP2 x DP2
        (("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"), 2),
    ],
    ids=["tp2xpp2", "pp2xdp2", "pp2xvpp2"],
)
def test_tp1_checkpoint_trains_on_with_the_same_losses_under(megatron_lm, tp1, tp1_resumed, tmp_path, layout, nproc):
    # Against TP1 resumed from the same checkpoint: the same start, only the layout differs.
    reference, _ = tp1_resumed
    resumed = losses(resumed_under(megatron_lm, tp1, tmp_path, *layout, nproc=nproc))
    assert_close(resumed, reference, RESUMED, rel=1e-5)


def test_simple_mcore_train_loop_runs_with_its_dist_checkpoint_save_and_load(megatron_lm, tmp_path):
    job = upstream(megatron_lm, nproc=2, cwd=tmp_path, script="examples/run_simple_mcore_train_loop.py").check()
    assert len(re.findall(r"Iteration \d: Losses reduced", job.stdout)) == 2 * 5  # every rank, 5 iterations
    assert job.stdout.count("Successfully loaded the model") == 2
    assert list((tmp_path / "ckpt").glob("*.distcp"))


def test_another_megatron_lm_version_is_one_error_naming_both(megatron_lm, tmp_path):
    # A checkout of another release: its megatron/core/package_info.py says so (the wheel's
    # megatron.core is still the one imported: the checkout's core has no __init__.py here).
    other = tmp_path / "other"
    (other / "megatron" / "core").mkdir(parents=True)
    (other / "megatron" / "training").symlink_to(megatron_lm / "megatron" / "training")
    for name in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py"):  # copies: python resolves a
        shutil.copy(megatron_lm / name, other / name)  # symlinked script's directory to the link's target
    (other / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 15\nPATCH = 2\nPRE_RELEASE = ''\n")
    job = run(
        [sys.executable, "-m", "megatron_npu.run", str(other / "pretrain_gpt.py"), *MODEL],
        env=env_for(other),
        timeout=600,
    )
    assert job.returncode == 2, job.stderr[-3000:]
    assert "Megatron-LM 0.15.2" in job.stderr and "core_v0.16.1" in job.stderr
    assert "Traceback" not in job.stderr


def test_device_impossible_flag_is_one_line_before_any_process_group(megatron_lm):
    job = run(
        [
            sys.executable,
            "-m",
            "megatron_npu.run",
            str(megatron_lm / "pretrain_gpt.py"),
            *MODEL,
            "--fp8-format",
            "hybrid",
        ],
        env=env_for(megatron_lm),
        timeout=600,
    )
    assert job.returncode == 2
    assert "--fp8-format hybrid is not supported" in job.stderr or "--fp8-format is not supported" in job.stderr
    assert "Traceback" not in job.stderr


# Megatron-LM core_v0.16.1's parser beside pretrain_gpt.py's, in one process of the user's set-up
# (the extract on the path, the patch layer applied): every upstream flag pretrain_gpt.py does
# not accept, with no policy row, and every accepted flag whose default differs.
_SURFACE = """
import argparse, enum, json
import megatron_npu
from megatron.training.arguments import add_megatron_arguments
from megatron_npu.policy import flag_policy
from megatron_npu.training.arguments import build_parser

def defaults(parser):
    found = {}
    for action in parser._actions:
        value = action.default
        value = value.name if isinstance(value, enum.Enum) else value
        found.update((flag, value) for flag in action.option_strings if flag.startswith("--"))
    return found

upstream = defaults(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
ours = defaults(build_parser())
print(json.dumps({
    "uncovered": sorted(f for f in upstream if f not in ours and flag_policy(f) is None),
    "defaults": {f: [repr(upstream[f]), repr(ours[f])] for f in upstream if f in ours and upstream[f] != ours[f]},
}))
"""
# defaults pretrain_gpt.py chooses differently, on purpose
OWN_DEFAULTS = {
    "--transformer-impl": "local: Transformer Engine is CUDA-only",
    "--eval-interval": "1000: upstream's None stops its own dataset sizing (train_iters // eval_interval)",
}


def test_every_flag_of_megatron_lm_core_v0_16_1_is_accepted_or_answered_by_the_policy(megatron_lm):
    job = run([sys.executable, "-c", _SURFACE], env=env_for(megatron_lm), timeout=600).check()
    surface = json.loads(job.stdout.strip().splitlines()[-1])
    assert surface["uncovered"] == [], "flags neither accepted nor in megatron_npu/policy.py"
    assert set(surface["defaults"]) == set(OWN_DEFAULTS), surface["defaults"]


def test_missing_script_is_one_line():
    job = run([sys.executable, "-m", "megatron_npu.run", "no_such_pretrain.py"], timeout=600)
    assert job.returncode == 2 and "no such script" in job.stderr and "Traceback" not in job.stderr


def test_this_projects_pretrain_gpt_trains_the_same_model_from_the_same_seed(tp1, tmp_path):
    reference, _ = tp1
    job = torchrun(
        ROOT / "pretrain_gpt.py", *MODEL, "--log-dir", str(tmp_path / "logs"), nproc=1, env=base_env(), timeout=300
    ).check()
    own = losses(job)
    assert sorted(own) == sorted(reference)
    # The same gradients every iteration (the printed norm), and the same losses, but for upstream's
    # logging quirk: its second logged lm loss is the mean of iterations 1 and 2 (README).
    assert grad_norms(job) == UPSTREAM_NORMS["tp1"] and len(UPSTREAM_NORMS["tp1"]) == len(reference)
    assert_close(own, reference, tuple(i for i in sorted(reference) if i != 2), rel=1e-5)
    assert reference[2] == pytest.approx((own[1] + own[2]) / 2, rel=1e-6)
