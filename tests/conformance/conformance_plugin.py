"""pytest plugin loaded into every rank of a conformance run (``-p conformance_plugin``).

It imports the patch layer before megatron-core's own conftest imports megatron-core, records
every test's outcome per rank as JSON lines (the runner merges the ranks), and turns a test
that outlives its timeout into a named failure: every thread's stack is written, then the
rank exits, so torchrun stops the job and the runner restarts it after that test.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib.util
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import megatron_npu  # noqa: F401  (the patch layer, applied on import, in every rank)

# The suite gates its device tests on torch.cuda.is_available(). Every torch.cuda call it makes
# reaches the accelerator (on the cpu target: the host), so in this harness it answers True and the
# cpu target runs the device paths npu runs, instead of skipping them. Only here: elsewhere on cpu
# torch itself reads it (inductor) and must see a CPU build.
torch.cuda.is_available = lambda: True

OUT_ENV = "CONFORMANCE_OUT"
TIMEOUT_ENV = "CONFORMANCE_TEST_TIMEOUT"
DESELECT_ENV = "CONFORMANCE_DESELECT"
HANG_EXIT = 86
_RANK = os.environ.get("RANK", "0")
_write_lock = threading.Lock()


def _out_dir() -> Path:
    return Path(os.environ.get(OUT_ENV, "."))


def _record(payload: dict[str, Any]) -> None:
    line = json.dumps({"rank": int(_RANK), **payload})
    with _write_lock, open(_out_dir() / f"rank{_RANK}.jsonl", "a") as sink:
        sink.write(line + "\n")  # one write per record: ranks never interleave within a file


def _stack_file() -> Any:
    return open(_out_dir() / f"stacks-rank{_RANK}.txt", "a")  # noqa: SIM115 (held for faulthandler)


def pytest_configure(config: pytest.Config) -> None:
    # torchrun stops the other ranks with SIGTERM after one exits: their stacks too.
    config._conformance_stacks = _stack_file()  # type: ignore[attr-defined]
    faulthandler.register(signal.SIGTERM, file=config._conformance_stacks, all_threads=True, chain=True)
    _quiet_torch_debug_logging()
    _patch_spawned_children()


def _patch_spawned_children() -> None:
    """Harness: a process started with multiprocessing's spawn method (megatron-core's persistent async
    checkpoint writer) is a fresh interpreter that imports only what ``__main__``'s spec names, and
    ``pytest.__main__`` it skips: the child ran unpatched, raised ZeroDivisionError on CUDA's device count
    of 0, and its parent waited forever (dist_checkpointing/test_async_save.py hung). A user's run through
    ``-m megatron_npu.run`` gets patched children from that module's ``__mp_main__`` branch: the same here."""
    main = sys.modules.get("__main__")
    if main is not None:
        main.__spec__ = importlib.util.find_spec("megatron_npu.run")


def _quiet_torch_debug_logging() -> None:
    """Harness: with pytest 9, caplog's handler sits on the root logger at level 0, and torch
    2.13's loggers (no level of their own below WARNING) then pass their DEBUG records into
    tests that assert on caplog's exact content. Upstream pins pytest 8.3.5; torch's loggers are
    held at WARNING here, which touches none of megatron-core's loggers."""
    logging.getLogger("torch").setLevel(logging.WARNING)


#: The markers the runner's ``-m`` expression deselects (run.py's DESELECTED_MARKERS), so that each deselected test
#: is counted under its marker.
DESELECTING_MARKERS = tuple(filter(None, os.environ.get("CONFORMANCE_DESELECTED_MARKERS", "").split(",")))


@pytest.hookimpl(hookwrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Any:
    """Rank 0 records what was collected and what ``-m`` deselected, by marker (the accounting's first terms);
    then the tests an earlier attempt finished are left out (a restarted job runs the rest)."""
    collected = [item.nodeid for item in items]
    by_marker = {}
    for item in items:
        marker = next((name for name in DESELECTING_MARKERS if item.get_closest_marker(name)), None)
        if marker is not None:
            by_marker[item.nodeid] = marker
    yield
    if _RANK == "0":
        _record({"nodeid": "", "event": "collection", "collected": collected, "deselected": by_marker})
    listed = os.environ.get(DESELECT_ENV)
    if not listed:
        return
    done = set(Path(listed).read_text().splitlines())
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
    items[:] = [item for item in items if item.nodeid not in done]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Harness: what exists once the suite is collected (torch, megatron-core, the test modules: ~440,000
    objects) lives until the session ends, yet every full collection after each test (below) walked it
    again: 0.3-0.4 s a rank, 8 ranks on 2 cores, about 3 s a test, half the subset's time in CI. Frozen,
    it is left out of collections; what a test creates is still collected."""
    gc.collect()
    gc.freeze()


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        exception, first_line = _collect_exception(str(report.longrepr))
        payload = {"nodeid": report.nodeid, "event": "collect_error", "message": _message(report)}
        _record({**payload, "exception": exception, "first_line": first_line, "hidden": _hidden_tests(report)})
    elif report.skipped and isinstance(report.longrepr, tuple):  # a module-level skip (importorskip)
        _record({"nodeid": report.nodeid, "event": "module_skip", "message": report.longrepr[2]})


# pytest's collection error text: the exception's line is the last 'E   Type: message' line.
_COLLECT_EXCEPTION = re.compile(r"^E\s+([A-Za-z_][\w.]*(?:Error|Exception|Exit|Warning|Interrupt)):?\s?(.*)$", re.M)


def _collect_exception(text: str) -> tuple[str, str]:
    """Exception type and first message line of a collection error (pytest keeps only its text)."""
    found = _COLLECT_EXCEPTION.findall(text)
    if not found:
        return "", text.strip().splitlines()[-1] if text.strip() else ""
    name, line = found[-1]
    return name.rsplit(".", 1)[-1], line.strip()


def _hidden_tests(report: pytest.CollectReport) -> int | None:
    """How many tests a file that failed to import would have held: its ``def test_`` functions, each
    parametrize counted once (a lower bound; None when the file cannot be read)."""
    path = Path(str(report.fspath)) if getattr(report, "fspath", None) else None
    if path is None or not path.is_file():
        return None
    return len(re.findall(r"^\s*def test_\w*\(", path.read_text(errors="replace"), re.M))


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _record({"nodeid": nodeid, "event": "start", "time": time.time()})


def _message(report: Any) -> str:
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return f"{crash.message} ({Path(crash.path).name}:{crash.lineno})"
    return str(getattr(report, "longrepr", ""))[-2000:]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Upstream runs its suite twice: ``-m "not experimental ..."``, then ``--experimental -m "experimental ..."``
    (tests/unit_tests/run_ci_test.sh). One session here: the conftest's autouse ``experimental`` fixture reads the
    option, so an experimental test sees it set and every other test unset, as in upstream's two runs."""
    item.config.option.experimental = item.get_closest_marker("experimental") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """The failure's exception type and its message's first line, kept on the report: the expected list
    matches them (pytest's report keeps only the formatted text)."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and report.failed:
        lines = str(call.excinfo.value).strip().splitlines()
        report.conformance_exception = (call.excinfo.typename, lines[0].strip() if lines else "")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    payload: dict[str, Any] = {"nodeid": report.nodeid, "event": report.when, "outcome": report.outcome}
    payload["duration"] = round(report.duration, 3)
    if report.failed:
        payload["message"] = _message(report)
        payload["exception"], payload["first_line"] = getattr(report, "conformance_exception", ("", ""))
        payload["detail"] = str(report.longrepr)[-6000:]
    elif report.skipped:
        payload["xfail"] = hasattr(report, "wasxfail")
        longrepr = report.longrepr
        payload["message"] = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    elif hasattr(report, "wasxfail"):
        payload["xpass"] = True
    _record(payload)


def _on_timeout(nodeid: str, timeout: float, stacks: Any) -> None:
    _record({"nodeid": nodeid, "event": "hang", "message": f"no result after {timeout:.0f} s"})
    stacks.write(f"\n=== rank {_RANK}: {nodeid} ran past {timeout:.0f} s; every thread:\n")
    stacks.flush()
    faulthandler.dump_traceback(file=stacks, all_threads=True)
    stacks.flush()
    os._exit(HANG_EXIT)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Harness: pytest keeps every test's class instance until the session ends (``Function._instance``),
    and with it what ``setup_method`` stored: models and ``ProcessGroupCollection``s. A gloo group keeps
    its threads until its last reference dies, even once destroyed (``shutdown``/``abort`` stop none),
    so 8 ranks piled up ~1000 threads each over transformer/ (test_attention_variant_dsa.py: +40 a test)
    and drove the load past 50. The instance's attributes are dropped once the test is torn down."""
    yield
    instance = getattr(item, "instance", None)
    if instance is not None:
        vars(instance).clear()
    gc.collect()  # models hold reference cycles: their groups go now, not at some later collection
    _destroy_groups_the_test_left()


def _destroy_groups_the_test_left() -> None:
    """Harness: tests that build their own groups (new_group, HyperCommGrid: test_transformer_block_custom_pgs.py)
    never destroy them, and each gloo group polls its socket every 10 ms: 8 ranks x 200 threads drove the load
    past 100. After each test the groups megatron-core's parallel_state does not hold are destroyed, once every
    member has released them (the patch layer's check-in: no group is closed under a peer)."""
    from megatron_npu.patches.distributed import destroy_when_released, groups_megatron_created

    if not torch.distributed.is_initialized():
        return
    held = {id(group) for group in groups_megatron_created()}
    pg_map = torch.distributed.distributed_c10d._world.pg_map
    destroy_when_released([group for group in list(pg_map) if id(group) not in held])
    gc.collect()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    timeout = float(os.environ.get(TIMEOUT_ENV, "300"))
    timer = threading.Timer(timeout, _on_timeout, args=(item.nodeid, timeout, item.config._conformance_stacks))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
