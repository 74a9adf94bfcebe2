"""The quick check of every release the full matrix (test_release_matrix.py) leaves out: what fits CI's budget.

Per release, in its cached venv on the cpu target, five processes instead of the matrix's seven launches:
- the doctor (one process) with that tag's Megatron-LM checkout on the path: every patch claiming the release
  finds its target, megatron/training's included, none left pending;
- ONE 4-rank launch of the GPU-written megatron-core script (gpu_style_layouts.py), re-initialising model
  parallelism between its parts: TP2 x PP2 and PP2 x DP2 with the distributed optimizer train with the TP1
  reference's losses (rel 1e-5; the reference computed in the same job, TP1 x PP1 over DP4), and a megatron-core
  dist-checkpoint of the PP2 x DP2 run resumes exactly (losses and every parameter);
- that tag's Megatron-LM pretrain_gpt.py through ``-m megatron_npu.run`` (one rank, 6 iterations saving at 3, a
  resume from 3; every tensor of the two iteration-6 checkpoints compared), as the full matrix runs it.
Any "patch ... does not exist" line of the registry in any process fails the check. What it leaves to the full
matrix (``MEGATRON_NPU_RELEASES=all``): the TP1 reference and TP2 x PP2 as separate launches, and this project's
pretrain_gpt.py (MoE, TP2 x PP2 x EP2) with its checkpoints.

Which releases: all but those the full matrix runs (by default 0.13.1, 0.14.0, 0.15.3, 0.17.1, 0.18.2). A venv
missing from the cache is built on first use (envs.py), so a fresh machine verifies every release; only a machine
without the release's Python (3.11 or 3.12) skips it, with one line.
Measured on 2 shared cores (doctor + launch, seconds, venvs cached): 0.13.1 5 + 39, 0.14.0 27 + 66 (a loaded
machine), 0.15.3 9 + 38, 0.17.1 16 + 47, 0.18.2 9 + 36; the Megatron-LM part costs what it does in the full matrix
(39-51 s a release on a quiet machine; 0.13.1 319 s with the load at 40). Each run writes its figures (seconds,
worst relative differences, exact resumes) to figures.json beside its runs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed import ROOT  # noqa: E402
from envs import RELEASES, release_env  # noqa: E402
from release_checks import (  # noqa: E402
    MISSING_TARGET,
    SAVE_AT,
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
LAYOUTS = ROOT / "tests" / "releases" / "gpu_style_layouts.py"


def quick_releases() -> list:
    left = [name for name in RELEASES if name not in full_matrix_releases()]
    return left or [pytest.param(None, marks=pytest.mark.skip("the full matrix runs every release"))]


@pytest.fixture(scope="module", params=quick_releases())
def quick_runs(request, tmp_path_factory) -> dict:
    release = RELEASES[request.param]
    reason = unavailable(release)
    if reason:
        pytest.skip(reason)
    began = time.monotonic()
    python = release_env(release)
    where = tmp_path_factory.mktemp(f"quick-{release.core}")
    seconds = {"venv": time.monotonic() - began}
    began = time.monotonic()
    checkout, env = tag_checkout(release, where)
    checked = doctor(python, env)
    seconds["doctor"] = time.monotonic() - began
    began = time.monotonic()
    job = torchrun(
        python,
        LAYOUTS,
        "--steps",
        str(STEPS),
        "--save-at",
        str(SAVE_AT),
        "--ckpt",
        str(where / "ckpt"),
        nproc=4,
        env=env,
    )
    seconds["launch"] = time.monotonic() - began
    began = time.monotonic()
    upstream = megatron_lm_train_and_resume(release, python, checkout, env, where / "megatron-lm-run")
    seconds["megatron_lm"] = time.monotonic() - began
    runs = {"release": release, "doctor": checked, "layouts": job, "results": job.by_rank(), **upstream}
    record_figures(where, release, seconds, lambda: rel_errors(runs))
    return runs


def rel_errors(runs: dict) -> dict:
    results = runs["results"]
    reference = last_stage(results, "reference")
    return {
        "megatron_lm_resume_exact": megatron_lm_resumed_exactly(runs),
        "gpu_style_tp2pp2": worst(last_stage(results, "tp2pp2"), reference),
        "gpu_style_pp2dp2_dist_opt": worst(last_stage(results, "uninterrupted"), reference),
        "gpu_style_resume_exact": last_stage(results, "resumed") == last_stage(results, "uninterrupted")[SAVE_AT:],
    }


def test_quick_doctor_is_clean_and_no_claimed_target_is_missing(quick_runs):
    assert_doctor_clean(quick_runs["release"], quick_runs["doctor"])
    for name in ("doctor", "layouts", "full", "resumed"):
        assert MISSING_TARGET not in quick_runs[name].stderr, f"{name}: {quick_runs[name].stderr[-3000:]}"


def test_quick_layouts_train_with_the_tp1_references_losses(quick_runs):
    results = quick_runs["results"]
    reference = last_stage(results, "reference")
    assert len(set(reference)) == STEPS, "training moved the loss"
    assert len({json.dumps(r["reference"]) for r in results.values()}) == 1  # TP1 x PP1: every rank is last
    assert_close(last_stage(results, "tp2pp2"), reference)
    assert_close(last_stage(results, "uninterrupted"), reference)
    assert {r["backend"] for r in results.values()} == {"gloo"} and {r["dp_rank"] for r in results.values()} == {0, 1}


def test_quick_dist_checkpoint_resume_is_exact(quick_runs):
    results = quick_runs["results"]
    assert last_stage(results, "resumed") == last_stage(results, "uninterrupted")[SAVE_AT:]
    assert [r["unequal_params"] for r in results.values()] == [[]] * 4


def test_quick_megatron_lm_pretrain_gpt_trains_and_resumes_bit_exactly(quick_runs):
    assert_megatron_lm_trains_and_resumes_bit_exactly(quick_runs)
