"""Shared test set-up. Tests live in the folder of the package part they specify (tests/training/
for megatron_npu/training, ...); tests/test_*.py at the top check project-wide rules. A test that
starts a process (torchrun, a script, a tool) carries ``@pytest.mark.launch``: ``pytest -m "not
launch"`` is the fast lane, and an unmarked test that starts one fails here, so the lane stays fast."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Tests run on the cpu target unless a test says otherwise; set before megatron_npu imports.
os.environ.setdefault("MEGATRON_NPU_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def megatron_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Megatron-LM core_v0.16.1's training stack unpacked as a user's checkout (tests/megatron_lm_checkout.py)."""
    from megatron_lm_checkout import TARBALL, unpack

    return unpack(TARBALL, tmp_path_factory.mktemp("megatron-lm"))


@pytest.fixture(scope="module")
def model_parallel():
    """megatron-core's modules read their groups (TP, EP, ...) from parallel_state: a 1-rank gloo
    world in this process, for tests of single modules."""
    import torch.distributed as dist
    from distributed import free_port
    from megatron.core import parallel_state, tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


class LaunchWithoutMarker(AssertionError):
    pass


# Whether the test being set up or run may start processes. Fixtures of any scope start theirs
# while the first test that needs them is set up, so the flag is that test's marker.
_may_launch = {"now": True, "test": ""}
_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self, *args, **kwargs):
    if not _may_launch["now"]:
        raise LaunchWithoutMarker(f"{_may_launch['test']} starts a process: mark it @pytest.mark.launch")
    _popen_init(self, *args, **kwargs)


def pytest_configure(config):
    subprocess.Popen.__init__ = _guarded_popen_init


def pytest_unconfigure(config):
    subprocess.Popen.__init__ = _popen_init


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _may_launch.update(now=item.get_closest_marker("launch") is not None, test=item.nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    _may_launch["now"] = True  # fixtures of every scope end here; what they stop is theirs


# ---- the set-up step: what the selected tests need fetched, fetched before the first test ----------------------
_wheel_unavailable: dict[str, str] = {}


def _run_may_launch(config: pytest.Config) -> bool:
    """Whether the mark expression keeps launch-marked tests (the fast lane, ``-m "not launch"``, does not)."""
    from _pytest.mark.expression import Expression  # pytest's own evaluator of -m

    expression = config.getoption("markexpr", "")
    return not expression or Expression.compile(expression).evaluate(lambda name, **_: name == "launch")


def pytest_collection_finish(session: pytest.Session) -> None:
    import torch_npu_wheel

    wanted = any("torch_npu_wheel" in getattr(item, "fixturenames", ()) for item in session.items)
    if not wanted or torch_npu_wheel.cached() is not None:
        return
    if not _run_may_launch(session.config):
        _wheel_unavailable["why"] = (
            f"{torch_npu_wheel.SPEC} wheel: not cached, and the fast lane downloads nothing "
            "(the whole suite fetches it in its set-up step)"
        )
        return
    try:
        torch_npu_wheel.download()
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        _wheel_unavailable["why"] = f"{torch_npu_wheel.SPEC} wheel: {error}"


@pytest.fixture(scope="session")
def torch_npu_wheel():
    """The torch_npu wheel the npu target is checked against, as a zip (tests/torch_npu_wheel.py)."""
    import zipfile

    import torch_npu_wheel as wheels

    found = wheels.cached()
    if found is None:
        pytest.skip(_wheel_unavailable.get("why", f"{wheels.SPEC} wheel: not fetched"))
    return zipfile.ZipFile(found)


# ---- the closing line: what this run did not verify, and why ---------------------------------------------------
_not_verified: dict[str, int] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        _not_verified[reason] = _not_verified.get(reason, 0) + 1


def not_verified_line(skips: dict[str, int], deselected: int) -> str:
    """One line naming what a run left unverified: skip reasons of the form ``subject: why`` that share their
    ``why`` are merged (``megatron-core 0.17.1, 0.18.2: ...``); the count of tests follows each reason."""
    merged: dict[str, tuple[list[str], int]] = {}
    for reason, count in skips.items():
        subject, sep, why = reason.partition(": ")
        key = why if sep and len(subject) <= 40 else reason
        subjects, total = merged.get(key, ([], 0))
        merged[key] = ([*subjects, subject] if sep and key == why else subjects, total + count)
    parts = []
    for why, (subjects, count) in merged.items():
        named = f"{_common_prefix_join(subjects)}: {why}" if subjects else why
        parts.append(f"{named} ({count} test{'s' if count != 1 else ''})")
    if deselected:
        parts.append(f"{deselected} test{'s' if deselected != 1 else ''} deselected (-m / -k)")
    return "not verified in this run: " + ("; ".join(parts) if parts else "nothing (every collected test ran)")


def _common_prefix_join(subjects: list[str]) -> str:
    """``["megatron-core 0.17.1", "megatron-core 0.18.2"]`` -> ``"megatron-core 0.17.1, 0.18.2"``."""
    words = [s.rsplit(" ", 1) for s in subjects]
    if len(subjects) > 1 and all(len(w) == 2 for w in words) and len({w[0] for w in words}) == 1:
        return f"{words[0][0]} " + ", ".join(w[1] for w in words)
    return ", ".join(subjects)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    yield  # the outermost wrapper: after pytest's short summary, just before its closing count
    if config.option.collectonly:
        return
    deselected = len(terminalreporter.stats.get("deselected", []))
    terminalreporter.write_line(not_verified_line(_not_verified, deselected), bold=True)
