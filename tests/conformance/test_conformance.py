"""The conformance runner: its verdict logic (fast), and the CI subset of megatron-core's suite on the
patch layer, 8 ranks as upstream runs it: tensor_parallel (TP layers, mappings, RNG tracker, cross
entropy) and pipeline_parallel/test_schedules.py (1F1B and interleaved schedules, custom process
groups), about 7.5 minutes on 2 shared cores (175 s + 273 s, measured 2026-12-04). The other
folders: python -m tests.conformance.run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

from .environment import TEST_PACKAGES, missing_line, missing_test_packages
from .expected import EXPECTED_FAILURES, TARGET_LIMITS, ExpectedFailure
from .results import FolderReport, judge, merge
from .suite import CONFTEST, CONFTEST_EDITS, REPO, TARBALL, edit_conftest

CI_FOLDERS = ("tensor_parallel", "pipeline_parallel/test_schedules.py")


def _records(rank: int, nodeid: str, *events: tuple[str, str]) -> list[dict]:
    return [{"rank": rank, "nodeid": nodeid, "event": when, "outcome": outcome} for when, outcome in events]


def test_a_test_takes_the_worst_outcome_of_its_ranks_and_a_hang_is_named():
    ok = (("start", ""), ("setup", "passed"), ("call", "passed"), ("teardown", "passed"))
    records = _records(0, "a", *ok) + _records(1, "a", ("start", ""), ("setup", "passed"), ("call", "failed"))
    records += _records(1, "a", ("teardown", "passed"))
    records += _records(0, "b", ("start", ""), ("setup", "passed")) + _records(1, "b", ("start", ""))
    records += [{"rank": 1, "nodeid": "b", "event": "hang", "message": "no result after 300 s"}]
    records += _records(0, "c", ("start", ""), ("setup", "skipped"), ("teardown", "passed"))
    records += _records(0, "d", ("start", ""), ("setup", "passed"))  # the job died under it
    merged = merge(records)
    assert {nodeid: result.outcome for nodeid, result in merged.items()} == {
        "a": "failed",
        "b": "hang",
        "c": "skipped",
        "d": "crash",
    }
    assert merged["b"].message == "no result after 300 s"


def test_the_verdict_names_unlisted_failures_and_listed_tests_that_pass_now():
    listed = EXPECTED_FAILURES[0].pattern.replace("[[]", "[").replace("[]]", "]")
    records = _records(0, listed, ("start", ""), ("setup", "passed"), ("call", "passed"), ("teardown", "passed"))
    records += _records(0, "x::y", ("start", ""), ("setup", "passed"), ("call", "failed"), ("teardown", "passed"))
    verdict = judge([FolderReport("f", merge(records))])
    assert [result.nodeid for result in verdict.unexpected] == ["x::y"]
    assert [result.nodeid for result, _ in verdict.now_passing] == [listed]
    assert not verdict.clean


def test_only_transformer_engine_or_cuda_only_causes_may_be_expected_and_target_limits_name_a_capability():
    assert {entry.cause for entry in EXPECTED_FAILURES} <= {"te", "cuda_only"}
    assert all(entry.capability for entry in TARGET_LIMITS)
    with pytest.raises(ValueError, match="only"):
        ExpectedFailure("t", "patch", "a patch-layer defect is fixed, not listed")
    from megatron_npu.accelerator.cpu import CpuAccelerator

    assert all(CpuAccelerator().capability(entry.capability) for entry in TARGET_LIMITS)


def test_the_conftest_edits_apply_to_the_suites_conftest(tmp_path):
    with tarfile.open(TARBALL) as archive:
        archive.extract(CONFTEST, tmp_path, filter="data")
    edit_conftest(tmp_path)
    text = (tmp_path / CONFTEST).read_text()
    assert "download_and_extract_asset" not in text.split("def ensure_test_data")[0]
    assert all(new in text for old, new in CONFTEST_EDITS if new)


def test_missing_test_packages_are_named_in_one_line_with_their_install_commands():
    missing = missing_test_packages(find=lambda name: None if name != "fastapi" else object())
    assert set(missing) == set(TEST_PACKAGES) - {"fastapi"}
    line = missing_line(missing)
    assert "\n" not in line and "emerging_optimizers (pip install --no-deps git+" in line
    assert "uvicorn (pip install -e '.[conformance]')" in line
    assert missing_line({}) == ""


@pytest.mark.launch
def test_megatron_cores_tensor_parallel_and_schedule_suites_pass_on_the_patch_layer(tmp_path):
    out = tmp_path / "results"
    command = [sys.executable, "-m", "tests.conformance.run", *CI_FOLDERS, "--out", str(out), "--timeout", "400"]
    job = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=2400)
    assert job.returncode == 0, job.stdout[-8000:] + job.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    passed = {
        folder: " ".join(nodeid for nodeid, result in tests.items() if result["outcome"] == "passed")
        for folder, tests in results.items()
    }
    assert len(passed["tensor_parallel"].split()) >= 20, job.stdout[-4000:]
    assert "test_gather_split_1d_tensor" in passed["tensor_parallel"]  # gloo's shape check answered
    assert "test_checkpoint_without_output" in passed["tensor_parallel"]  # fp8=False, without TE
    schedules = passed["pipeline_parallel/test_schedules.py"]
    assert len(schedules.split()) >= 60, job.stdout[-4000:]  # skipped as 'CUDA not available' before
    assert schedules.count("_with_custom_pgs") == 3  # new_group with per-process rank lists: lazy gloo


def test_a_resumed_run_keeps_finished_tests_and_reruns_the_one_a_kill_interrupted(tmp_path):
    from .run import _earlier_attempts

    ok = (("start", ""), ("setup", "passed"), ("call", "passed"), ("teardown", "passed"))
    attempt = tmp_path / "attempt0"
    attempt.mkdir()
    records = _records(0, "done", *ok) + _records(0, "killed", ("start", ""), ("setup", "passed"))
    (attempt / "rank0.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    (attempt / "seconds.txt").write_text("12.5")
    kept, seconds, count = _earlier_attempts(tmp_path)
    assert set(merge(kept)) == {"done"} and seconds == 12.5 and count == 1


_PROBE_MODULE = """
import sys

def probe(queue):
    import torch
    patched = "megatron_npu" in sys.modules and bool(sys.modules["megatron_npu"].applied_patches())
    queue.put((patched, torch.cuda.device_count()))
"""
_PROBE_MAIN = """
import sys
if __name__ == "__main__":  # like pytest's __main__: a spawn child does not run this
    import multiprocessing
    sys.path[:0] = sys.argv[1:]
    import conformance_plugin, probe_module
    conformance_plugin._patch_spawned_children()
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=probe_module.probe, args=(queue,))
    child.start()
    print("CHILD", *queue.get(timeout=600))  # a hang guard: spawning is slow on a busy machine
    child.join()
"""


@pytest.mark.launch
def test_a_spawned_child_of_a_conformance_rank_runs_on_the_patch_layer(tmp_path):
    """dist_checkpointing/test_async_save.py hung: megatron-core's persistent async writer is a spawn child, which
    ran unpatched (torch.cuda.device_count() 0: ZeroDivisionError) while its parent waited on it."""
    from .run import PLUGIN_DIR

    (tmp_path / "probe_module.py").write_text(_PROBE_MODULE)
    (tmp_path / "main.py").write_text(_PROBE_MAIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    job = subprocess.run(
        [sys.executable, str(tmp_path / "main.py"), str(PLUGIN_DIR), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    patched, devices = job.stdout.split("CHILD")[-1].split()
    assert patched == "True" and int(devices) >= 1  # CUDA's count on CPU torch is 0
