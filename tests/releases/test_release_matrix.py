"""The patch layer and this project's trainer on the other megatron-core releases (the default lane runs 0.16.1).

Per release, in its own venv (tests/releases/envs.py, cached), cpu target: the doctor is clean with that tag's
Megatron-LM checkout on the path (every patch claiming the release finds its target, megatron/training's
included); the GPU-written megatron-core script trains TP2 x PP2 and PP2 x DP2 with the distributed optimizer with
TP1's losses (rel 1e-5) and resumes from a dist-checkpoint exactly; Megatron-LM's own pretrain_gpt.py of that tag
trains through ``-m megatron_npu.run`` and resumes bit-exactly; this project's pretrain_gpt.py trains MoE (4
experts, EP2) under TP2 x PP2 with sequence parallelism, saves (0.13+; with the distributed optimizer from 0.15)
and resumes exactly. Seven launches per release (0.12, which refuses --save: six) and two single processes (doctor,
checkpoint comparison); the fixture prints (and writes beside the runs, figures.json) the worst relative loss
differences, whether the resumes were exact, and the seconds of each part: the README quotes them.

Which releases: ``MEGATRON_NPU_RELEASES`` (comma-separated, or ``all``). By default (CI) two: 0.12.1, the oldest
(MindSpeed-LLM's pin; the releases-only patches of megatron_npu/patches/release_fixes.py and most compat shims), and 0.19.2,
the newest (Python 3.12, triton stand-ins, 0.17+'s tokenizer and spec builders); a venv missing from the cache is
built on first use (the Python 3.12 CUDA torch took 84 s on a fresh machine: ``python tests/releases/envs.py``
builds them all ahead). Every other release gets test_release_quick.py's quick check in CI instead (the doctor, the
GPU-style layouts in one launch, and the tag's Megatron-LM pretrain_gpt.py trained and resumed).
Measured on 2 shared cores (seconds: GPU-style + Megatron-LM + this project's runs, one release at a time, venvs
cached; a 3.11 venv builds in 12-30 s from pip's wheel cache): 0.12.1 58 + 39 + 30 (one project launch), 0.13.1
58 + 46 + 63, 0.14.0 65 + 51 + 55, 0.15.3 192 + 207 + 157 (load ~50), 0.17.1 43 + 43 + 70, 0.18.2 115 + 137 + 207
(loaded), 0.19.2 49 + 44 + 62: CI's two about 5 min.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed import ROOT, Job, base_env  # noqa: E402
from envs import RELEASES, Release, release_env  # noqa: E402
from pretrain_runs import MODEL as PROJECT_MODEL  # noqa: E402
from pretrain_runs import NO_DROPOUT, PRETRAIN, checkpoint_at, train_losses  # noqa: E402
from release_checks import (  # noqa: E402
    MISSING_TARGET,
    SAVE_AT,
    SELECT_ENVVAR,
    STEPS,
    assert_close,
    assert_doctor_clean,
    assert_megatron_lm_trains_and_resumes_bit_exactly,
    doctor,
    full_matrix_releases,
    last_stage,
    megatron_lm_resumed_exactly,
    megatron_lm_train_and_resume,
    record_figures,
    tag_checkout,
    torchrun,
    unavailable,
    worst,
)

pytestmark = pytest.mark.launch
FIXTURE = ROOT / "tests" / "fixtures" / "gpu_style_gpt.py"
RESUME = ROOT / "tests" / "releases" / "gpu_style_resume.py"


def skipped_note() -> str:
    left = sorted(set(RELEASES) - set(full_matrix_releases()))
    return f"not run: {', '.join(left)} (set {SELECT_ENVVAR}=all)" if left else ""


def gpu_style(release: Release, python: Path, where: Path) -> dict:
    """TP1 reference, TP2 x PP2, and PP2 x DP2 with the distributed optimizer and a resume: 3 launches."""
    env, weights = base_env(), where / "weights.pt"
    common = ("--tied", "--steps", str(STEPS))
    reference = torchrun(python, FIXTURE, *common, "--save-init", str(weights), nproc=1, env=env)
    tp2pp2 = torchrun(python, FIXTURE, *common, "--tp", "2", "--pp", "2", "--init-from", str(weights), nproc=4, env=env)
    resume_args = ("--pp", "2", "--dist-opt", "--init-from", str(weights), "--ckpt", str(where / "ckpt"))
    dp2 = torchrun(python, RESUME, *resume_args, "--steps", str(STEPS), "--save-at", str(SAVE_AT), nproc=4, env=env)
    jobs = {"reference": reference, "tp2pp2": tp2pp2, "dp2": dp2}
    return {"jobs": jobs, **{name: job.by_rank() for name, job in jobs.items()}}


def megatron_lm(release: Release, python: Path, where: Path) -> dict:
    """That tag's pretrain_gpt.py trained and resumed (release_checks.py), and the doctor with its checkout."""
    checkout, env = tag_checkout(release, where)
    return {**megatron_lm_train_and_resume(release, python, checkout, env, where), "doctor": doctor(python, env)}


# MoE on more than one rank: 4 experts over EP2 (expert TP1) beside TP2 x PP2 (its token dispatch, its SP gathers)
PROJECT_MOE = ["--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
PROJECT_MOE += ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
PROJECT_MOE += ["--moe-token-dispatcher-type", "alltoall", "--sequence-parallel"]


def project_flags(release: Release) -> list[str]:
    flags = [*PROJECT_MODEL, *NO_DROPOUT, *PROJECT_MOE, "--mock-data", "--tokenizer-type", "NullTokenizer"]
    # no --legacy-tokenizer: a script written for 0.12-0.14 cannot carry it (those Megatron-LM tags have no such
    # flag); without megatron.core.tokenizers the trainer takes the legacy tokenizers itself, saying so in one line
    return [*flags, "--vocab-size", str(release.vocab_size), "--train-iters", str(STEPS)]


def checkpoint_flags(release: Release) -> list[str]:
    """This project's checkpoint flags the release can honour (the trainer refuses the others at start-up): none
    on 0.12 (no content metadata), the distributed optimizer's fully reshardable layout from 0.15."""
    if release.minor < 13:
        return []
    return ["--save-interval", str(SAVE_AT), *(["--use-distributed-optimizer"] if release.minor >= 15 else [])]


def project(release: Release, python: Path, where: Path) -> dict:
    """This project's pretrain_gpt.py on the release, MoE under TP2 x PP2 x EP2 (DP1, 4 micro-batches), saving every
    SAVE_AT iterations where the release allows, then resumed from SAVE_AT to STEPS: 2 launches (0.12: 1)."""
    run_dir, saving = where / "project-tp2pp2", checkpoint_flags(release)
    flags = [*project_flags(release), "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    flags += saving
    save = ["--save", str(run_dir / "ckpt")] if saving else []
    job = torchrun(python, PRETRAIN, *flags, *save, "--log-dir", str(run_dir / "logs"), nproc=4, env=base_env())
    runs = {"project_tp2pp2": job, "project_losses": train_losses(run_dir), "project_resumed_losses": None}
    if saving:
        resumed_dir = where / "project-resumed"
        root = checkpoint_at(run_dir / "ckpt", SAVE_AT, resumed_dir / "ckpt")
        resumed = torchrun(
            python,
            PRETRAIN,
            *flags,
            "--load",
            str(root),
            "--log-dir",
            str(resumed_dir / "logs"),
            nproc=4,
            env=base_env(),
        )
        runs.update(project_resumed=resumed, project_resumed_losses=train_losses(resumed_dir))
    return runs


@pytest.fixture(
    scope="module", params=full_matrix_releases() or [pytest.param(None, marks=pytest.mark.skip(skipped_note()))]
)
def release_runs(request, tmp_path_factory) -> dict:
    release = RELEASES[request.param]
    reason = unavailable(release)
    if reason:
        pytest.skip(reason)
    began = time.monotonic()
    python = release_env(release)
    where = tmp_path_factory.mktemp(f"mcore-{release.core}")
    seconds = {"venv": time.monotonic() - began}
    runs: dict = {"jobs": {}}
    for part in (gpu_style, megatron_lm, project):
        began = time.monotonic()
        found = part(release, python, where)
        runs["jobs"].update({k: v for k, v in found.pop("jobs", found).items() if isinstance(v, Job)})
        runs.update(found)
        seconds[part.__name__] = time.monotonic() - began
    record_figures(where, release, seconds, lambda: rel_errors(runs))
    return {"release": release, **runs}


def rel_errors(runs: dict) -> dict:
    """The largest relative loss differences the tests bound, and whether the resumes were exact."""

    reference, dp2 = last_stage(runs["reference"]), runs["dp2"]
    return {
        "gpu_style_tp2pp2": worst(last_stage(runs["tp2pp2"]), reference),
        "gpu_style_pp2dp2_dist_opt": worst(last_stage(dp2, "uninterrupted"), reference),
        "gpu_style_resume_exact": last_stage(dp2, "resumed") == last_stage(dp2, "uninterrupted")[SAVE_AT:],
        "megatron_lm_resume_exact": megatron_lm_resumed_exactly(runs),
        "project_tp2pp2_losses": runs["project_losses"],
        "project_resume_exact": project_resume_exact(runs),
    }


def project_resume_exact(runs: dict) -> bool | None:
    """Whether this project's resumed run logged the uninterrupted one's losses after SAVE_AT (None: not saved)."""
    resumed = runs["project_resumed_losses"]
    if resumed is None:
        return None
    return resumed == {i: v for i, v in runs["project_losses"].items() if i > SAVE_AT}


def test_doctor_is_clean_with_the_tags_megatron_lm(release_runs):
    assert_doctor_clean(release_runs["release"], release_runs["doctor"])


def test_no_patch_claiming_the_release_misses_its_target_in_any_run(release_runs):
    for name, job in release_runs["jobs"].items():
        assert MISSING_TARGET not in job.stderr, f"{name}: {job.stderr[-3000:]}"


def test_gpu_style_layouts_train_with_tp1s_losses(release_runs):
    reference = last_stage(release_runs["reference"])
    assert len(set(reference)) == STEPS, "training moved the loss"
    assert_close(last_stage(release_runs["tp2pp2"]), reference)
    dp2 = release_runs["dp2"]
    assert {r["backend"] for r in dp2.values()} == {"gloo"} and {r["dp_rank"] for r in dp2.values()} == {0, 1}
    assert_close(last_stage(dp2, "uninterrupted"), reference)


def test_gpu_style_dist_checkpoint_resume_is_exact(release_runs):
    dp2 = release_runs["dp2"]
    assert last_stage(dp2, "resumed") == last_stage(dp2, "uninterrupted")[SAVE_AT:]
    assert [r["unequal_params"] for r in dp2.values()] == [[]] * 4


def test_megatron_lm_pretrain_gpt_trains_and_resumes_bit_exactly(release_runs):
    assert_megatron_lm_trains_and_resumes_bit_exactly(release_runs)


def test_this_projects_pretrain_gpt_trains_moe_under_tp2_pp2_ep2(release_runs):
    trained = release_runs["project_losses"]
    assert sorted(trained) == list(range(1, STEPS + 1))
    assert all(math.isfinite(loss) for loss in trained.values()) and trained[STEPS] < trained[1]
    said = "has no megatron.core.tokenizers: Megatron-LM's legacy tokenizers are used"
    assert (said in release_runs["project_tp2pp2"].stderr) == (release_runs["release"].minor < 15)


def test_this_projects_checkpoints_resume_exactly_where_the_release_has_the_format(release_runs):
    release = release_runs["release"]
    if not checkpoint_flags(release):
        pytest.skip(f"megatron-core {release.core}: the trainer refuses --save / --load (test_compat_shims.py)")
    resumed = release_runs["project_resumed"]
    assert "successfully loaded checkpoint" in resumed.stdout
    assert sorted(release_runs["project_resumed_losses"]) == list(range(SAVE_AT + 1, STEPS + 1))
    assert project_resume_exact(release_runs) is True
