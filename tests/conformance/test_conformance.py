"""The conformance runner: its verdict logic (fast), and the CI subset of megatron-core's suite on the
patch layer, 8 ranks as upstream runs it: tensor_parallel (TP layers, mappings, RNG tracker, cross
entropy) and pipeline_parallel/test_schedules.py (1F1B and interleaved schedules, custom process
groups): 46 s + 55 s in a clean-clone CI run, 93 s + 121 s beside other jobs (load 35-75, 2026-12-05), every
collected test accounted for (27 and 65). The other folders: python -m tests.conformance.run."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from .environment import TEST_PACKAGES, missing_line, missing_test_packages, missing_tools_line
from .expected import ENVIRONMENT_LIMITS, EXPECTED_FAILURES, TARGET_LIMITS, ExpectedFailure, Need
from .results import FolderReport, collection_of, environment_line, judge, merge, table, unmet_needs
from .suite import (
    CONFTEST,
    CONFTEST_EDITS,
    LM_TOOLS,
    REPO,
    TAG,
    TARBALL,
    CheckoutError,
    edit_conftest,
    megatron_lm_files,
    missing_tools,
    unpack,
)

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
        ExpectedFailure("t", "patch", "a patch-layer defect is fixed, not listed", "KeyError", "step")
    with pytest.raises(ValueError, match="names its exception"):
        ExpectedFailure("t", "te", "a failure is named by its exception and message", "", "")
    from megatron_npu.accelerator.cpu import CpuAccelerator

    assert all(CpuAccelerator().capability(entry.capability) for entry in TARGET_LIMITS)


def _failure(rank: int, nodeid: str, exception: str, first_line: str) -> list[dict]:
    records = _records(rank, nodeid, ("start", ""), ("setup", "passed"))
    records.append(
        {"rank": rank, "nodeid": nodeid, "event": "call", "outcome": "failed"}
        | {"exception": exception, "first_line": first_line}
    )
    return records + _records(rank, nodeid, ("teardown", "passed"))


def test_a_listed_test_is_expected_only_when_it_fails_the_way_its_entry_states():
    entry = next(e for e in EXPECTED_FAILURES if "TestAllReduceLNGrads" in e.pattern)
    nodeid = entry.pattern.replace("*", "test_allreduce_layernorm_grads[True-2]")
    as_listed = _failure(0, nodeid, "NameError", "name 'TESpecProvider' is not defined")
    verdict = judge([FolderReport("f", merge(as_listed))])
    assert [r.nodeid for r, _ in verdict.expected] == [nodeid] and verdict.clean
    for exception, line in (("KeyError", "'step'"), ("NameError", "name 'local_spec' is not defined")):
        verdict = judge([FolderReport("f", merge(_failure(0, nodeid, exception, line)))])
        assert [r.nodeid for r in verdict.unexpected] == [nodeid] and not verdict.expected
        assert [r.nodeid for r, _ in verdict.failed_otherwise] == [nodeid]
        assert "failed otherwise" in table([FolderReport("f", merge(_failure(0, nodeid, exception, line)))], verdict)


def test_an_environment_limit_applies_only_where_its_need_is_unmet_and_only_to_the_failure_it_states():
    """dist_checkpointing/test_layer_wise_optimizer.py needs Emerging-Optimizers (git-only): 119 tests fail without it,
    counted apart; where it is installed they must pass, and a failure there is unexpected."""
    entry = next(e for e in ENVIRONMENT_LIMITS if "test_layer_wise_optimizer" in e.pattern)
    nodeid = entry.pattern.replace("*", "TestLayerWiseOptimizer::test_broadcast_params[1-2]")
    as_listed = FolderReport("f", merge(_failure(0, nodeid, "AssertionError", "Emerging Optimizers is not installed.")))
    verdict = judge([as_listed], unmet={entry.needs})
    assert [r.nodeid for r, _ in verdict.environment] == [nodeid] and not verdict.expected and verdict.clean
    assert environment_line(verdict) == "environment limits: 1 (needs emerging_optimizers: 1)"
    assert "| environment limits |" in table([as_listed], verdict)
    installed = judge([as_listed], unmet=set())  # the package is here: the test must pass
    assert [r.nodeid for r in installed.unexpected] == [nodeid] and not installed.environment
    otherwise = FolderReport("f", merge(_failure(0, nodeid, "KeyError", "'step'")))
    verdict = judge([otherwise], unmet={entry.needs})
    assert [r.nodeid for r, _ in verdict.failed_otherwise] == [nodeid] and not verdict.environment


def test_an_environment_limit_names_its_need_and_the_need_is_checked_on_this_machine(tmp_path):
    assert all(entry.cause == "environment" and entry.needs for entry in ENVIRONMENT_LIMITS)
    with pytest.raises(ValueError, match="names what it needs"):
        ExpectedFailure("t", "environment", "a need is named", "KeyError", "step")
    with pytest.raises(ValueError, match="a need is one of"):
        Need("network", "s3.amazonaws.com")
    assert Need("package", "json").met() and not Need("package", "no_such_package_for_conformance").met()
    assert Need("path", str(tmp_path)).met() and not Need("path", str(tmp_path / "absent")).met()
    tools = Need("megatron_lm", "Megatron-LM's tools (--megatron-lm)")
    assert tools.met(megatron_lm=True) and not tools.met()
    assert tools in unmet_needs() and tools not in unmet_needs(megatron_lm=True)


def test_every_collected_test_is_accounted_for_and_a_test_left_unrun_fails_the_verdict():
    ok = (("start", ""), ("setup", "passed"), ("call", "passed"), ("teardown", "passed"))
    collection = {"rank": 0, "nodeid": "", "event": "collection", "collected": ["a::p", "a::s", "a::f", "a::d"]}
    collection["deselected"] = {"a::d": "flaky"}
    records = [collection, *_records(0, "a::p", *ok), *_failure(0, "a::f", "ValueError", "bad")]
    skip = {"rank": 0, "nodeid": "a::s", "event": "setup", "outcome": "skipped", "message": "Skipped: needs TE"}
    records += _records(0, "a::s", ("start", "")) + [skip]
    records.append({"rank": 0, "nodeid": "m.py", "event": "module_skip", "message": "could not import 'modelopt': x"})
    hidden = {"rank": 0, "nodeid": "b.py", "event": "collect_error", "exception": "ModuleNotFoundError"}
    records.append(hidden | {"first_line": "No module named 'transformer_engine'", "hidden": 3})
    report = FolderReport("f", merge(records), collection=collection_of(records))
    assert report.balanced() and report.not_run() == []
    line = report.accounting()
    assert line.startswith("f: collected 4 = passed 1 + failed 1 + errors 0 + hangs/crashes 0 + skipped 1")
    assert "(needs TE: 1)" in line and "deselected 1 (flaky: 1)" in line and "not run 0" in line
    assert "1 files failed to import, hiding 3 test functions" in line and "m.py (needs modelopt)" in line
    unrun = [record for record in records if record.get("nodeid") != "a::p"]  # the restarts ran out before a::p
    report = FolderReport("f", merge(unrun), collection=collection_of(unrun))
    verdict = judge([report])
    assert report.not_run() == ["a::p"] and verdict.not_run == {"f": ["a::p"]} and not verdict.clean
    assert "not run 1" in report.accounting()


def test_device_name_limits_apply_wherever_cuda_tensors_report_another_device_type():
    """On npu a tensor moved with .cuda() reports 'npu': `device.type == 'cuda'` fails there as on the host, so
    these entries hang on a capability npu has too (runs_on_host, which npu lacks, made them must-pass there)."""
    from megatron_npu.accelerator.cpu import CpuAccelerator
    from megatron_npu.accelerator.npu import NpuAccelerator

    npu = object.__new__(NpuAccelerator)  # its capabilities, without torch_npu
    device_name = [entry for entry in TARGET_LIMITS if "== 'cuda'" in entry.message]
    assert len(device_name) == 6
    for entry in device_name:
        assert npu.capability(entry.capability) and CpuAccelerator().capability(entry.capability)


def test_a_file_run_apart_leaves_its_bucket_and_runs_with_its_own_ranks(tmp_path):
    """test_optimizer_cpu_offloading.py's BigNet at ~2.9 GB a rank: 8 ranks were OOM-killed on 24 GiB."""
    from .run import APART, TOP_LEVEL, _command

    for name in ("fusions", "utils", "inference"):
        (tmp_path / "tests" / "unit_tests" / name).mkdir(parents=True)
    bucket = _command(TOP_LEVEL, 8, tmp_path)
    assert "--ignore=tests/unit_tests/test_optimizer_cpu_offloading.py" in bucket
    assert "--ignore=tests/unit_tests/inference" in bucket and "--ignore=tests/unit_tests/fusions" not in bucket
    apart = _command("test_optimizer_cpu_offloading.py", 8, tmp_path)
    assert apart[apart.index("--nproc_per_node") + 1] == str(APART["test_optimizer_cpu_offloading.py"]) == "1"
    assert _command("inference", 8, tmp_path)[4] == "8"


def test_the_conftest_edits_apply_to_the_suites_conftest(tmp_path):
    with tarfile.open(TARBALL) as archive:
        archive.extract(CONFTEST, tmp_path, filter="data")
    edit_conftest(tmp_path)
    text = (tmp_path / CONFTEST).read_text()
    assert "download_and_extract_asset" not in text.split("def ensure_test_data")[0]
    assert all(new in text for old, new in CONFTEST_EDITS if new)


def _tarball(path, files: dict[str, str]):
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            member = tarfile.TarInfo(name)
            member.size = len(text.encode())
            archive.addfile(member, io.BytesIO(text.encode()))
    return path


def _git(repo, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True)


def test_megatron_lm_files_the_extracts_lack_are_added_beside_them_never_replacing_theirs(tmp_path):
    """data/ and test_tokenizer.py import Megatron-LM's tools/merge_datasets.py, which the shared extract lacks."""
    suite = _tarball(tmp_path / "suite.tar.gz", {CONFTEST: "".join(old for old, _ in CONFTEST_EDITS)})
    training = _tarball(tmp_path / "training.tar.gz", {"tools/preprocess_data.py": "the extract's"})
    assert missing_tools(training) == list(LM_TOOLS) and "tools/merge_datasets.py" in missing_tools()
    checkout = tmp_path / "Megatron-LM"  # a copy, not a git work tree: taken, and said to be unchecked
    (checkout / "tools").mkdir(parents=True)
    (checkout / "tools/merge_datasets.py").write_text("merge")
    files, where = megatron_lm_files(checkout, ["tools/merge_datasets.py"])
    assert files == {"tools/merge_datasets.py": b"merge"} and "not checked" in where
    with pytest.raises(CheckoutError, match="no tools/build_sequences_per_dataset.py, tools/preprocess_mmdata.py;"):
        megatron_lm_files(checkout, list(LM_TOOLS))

    work = tmp_path / "work"
    plain = unpack(suite, work, training)
    added = unpack(suite, work, training, added=files)
    assert (added / "tools/merge_datasets.py").read_bytes() == b"merge" and not (
        plain / "tools/merge_datasets.py"
    ).exists()
    assert unpack(suite, work, training, added=files) == added  # unpacked once per content
    other = unpack(suite, work, training, added={"tools/merge_datasets.py": b"other"})
    assert other != added and (other / "tools/merge_datasets.py").read_bytes() == b"other"
    assert (added / "tools/merge_datasets.py").read_bytes() == b"merge"  # a run beside keeps its tree
    with pytest.raises(FileExistsError):
        unpack(suite, work, training, added={"tools/preprocess_data.py": b"not the extract's"})


@pytest.mark.launch  # git, ~0.2 s
def test_a_git_checkout_gives_its_tags_files_and_a_work_tree_of_another_commit_is_refused(tmp_path):
    checkout = tmp_path / "Megatron-LM"
    (checkout / "tools").mkdir(parents=True)
    (checkout / "tools/merge_datasets.py").write_text("at the tag")
    wanted = ["tools/merge_datasets.py"]
    with pytest.raises(CheckoutError, match="cannot read tools/merge_datasets.py"):
        megatron_lm_files(tmp_path, wanted)  # neither a work tree nor a git directory
    _git(checkout, "init", "-q")
    _git(checkout, "add", ".")
    _git(checkout, "commit", "-qm", "tagged")
    _git(checkout, "tag", TAG)
    assert megatron_lm_files(checkout, wanted)[0] == {"tools/merge_datasets.py": b"at the tag"}
    (checkout / "tools/merge_datasets.py").write_text("after the tag")
    _git(checkout, "commit", "-qam", "later")
    with pytest.raises(CheckoutError, match=f"tools/merge_datasets.py not as at {TAG}"):
        megatron_lm_files(checkout, wanted)
    files, where = megatron_lm_files(checkout / ".git", wanted)  # a git directory: read at the tag
    assert files == {"tools/merge_datasets.py": b"at the tag"} and f"at {TAG}" in where


def test_missing_test_packages_are_named_in_one_line_with_their_install_commands():
    missing = missing_test_packages(find=lambda name: None if name != "fastapi" else object())
    assert set(missing) == set(TEST_PACKAGES) - {"fastapi"}
    line = missing_line(missing)
    assert "\n" not in line and "emerging_optimizers (pip install --no-deps git+" in line
    assert "uvicorn (pip install -e '.[conformance]')" in line
    assert missing_line({}) == ""
    tools = missing_tools_line(["tools/merge_datasets.py"], TAG)
    assert "\n" not in tools and "tools/merge_datasets.py" in tools and "--megatron-lm PATH" in tools
    assert missing_tools_line([], TAG) == ""


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


_PLUGIN_TESTS = {
    "test_kinds.py": """
import pytest

def test_fails():
    raise ValueError("the first line\\nand a second")

@pytest.mark.flaky
def test_deselected():
    pass

@pytest.mark.experimental
def test_experimental_sees_the_option(request):
    assert request.config.option.experimental is True

def test_others_do_not(request):
    assert request.config.option.experimental is False

@pytest.mark.skip(reason="needs TE")
def test_skipped():
    pass
""",
    "test_needs_a_package.py": "import pytest\npytest.importorskip('no_such_package_for_conformance')\n",
    "test_broken.py": "import no_such_module_for_conformance\n\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n",
}


@pytest.mark.launch
def test_the_plugin_records_failures_collection_deselection_and_module_skips(tmp_path):
    """One pytest session under the plugin, as a rank runs it (the patch layer imported, 5-10 s): a failure keeps
    its exception type and first line, rank 0 records what was collected and deselected by marker, a module skip
    names its package, a file that fails to import counts its tests, experimental tests see --experimental."""
    from .results import read_records
    from .run import MARKERS, _environment

    suite, out = tmp_path / "suite", tmp_path / "out"
    suite.mkdir(), out.mkdir()
    for name, text in _PLUGIN_TESTS.items():
        (suite / name).write_text(text)
    (out / "deselect.txt").write_text("")
    command = [sys.executable, "-m", "pytest", "-p", "conformance_plugin", "-p", "no:cacheprovider", "-q"]
    command += ["-m", MARKERS, "--continue-on-collection-errors", "-W", "ignore::pytest.PytestUnknownMarkWarning"]
    env = _environment(out, 300, out / "deselect.txt") | {"RANK": "0"}
    job = subprocess.run([*command, str(suite)], cwd=suite, env=env, capture_output=True, text=True, timeout=600)
    records = read_records(out)
    report = FolderReport("suite", merge(records), collection=collection_of(records))
    outcomes = {nodeid.rsplit("::", 1)[-1]: result for nodeid, result in report.results.items()}
    assert outcomes["test_fails"].exception == "ValueError", job.stdout[-3000:]
    assert outcomes["test_fails"].first_line == "the first line"
    assert outcomes["test_experimental_sees_the_option"].outcome == "passed"
    assert outcomes["test_others_do_not"].outcome == "passed"
    broken = outcomes["test_broken.py"]
    assert (broken.exception, broken.hidden) == ("ModuleNotFoundError", 2)
    assert broken.first_line == "No module named 'no_such_module_for_conformance'"
    assert report.balanced() and len(report.collection.collected) == 5
    line = report.accounting()
    assert "collected 5 = passed 2 + failed 1" in line and "skipped 1 (needs TE: 1)" in line
    assert "deselected 1 (flaky: 1)" in line and "not run 0" in line
    assert "test_needs_a_package.py (needs no_such_package_for_conformance)" in line
