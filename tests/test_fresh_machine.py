"""The suite passes on a machine that has never run it: nothing a test needs may come from a cache that an
earlier run filled on the side.

Each check runs pytest again with an empty home folder (no ``~/.cache/megatron-npu``, no wheel cache), the
rest of the machine as it is (the installed packages, pip's configuration):
- the torch_npu contract tests: the set-up step fetches the wheel into the empty cache and every one of them
  runs (on a fresh machine they once errored: their fixture downloaded inside an unmarked test);
- the fast lane (``-m "not launch"``): passes, starting no process and downloading nothing.
"""

from __future__ import annotations

import re
import sys

import pytest
from distributed import Job, base_env, run

pytestmark = pytest.mark.launch
HANG_GUARD_S = 1800  # a bound on a hang, not a guess at the time: the fast lane takes 25-60 s on 2 cores
CONTRACT = "tests/accelerator/test_npu_contract.py"


def pytest_in_an_empty_home(home, *args: str) -> Job:
    env = base_env(HOME=str(home))
    for inherited in ("MEGATRON_NPU_WHEEL_CACHE", "XDG_CACHE_HOME", "PYTEST_ADDOPTS"):
        env.pop(inherited, None)
    return run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], timeout=HANG_GUARD_S, env=env)


def counts(job: Job) -> dict[str, int]:
    closing = job.stdout.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", closing)}


def test_the_contract_tests_fetch_the_wheel_in_the_set_up_step_and_all_run(tmp_path):
    job = pytest_in_an_empty_home(tmp_path, CONTRACT)
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-2000:]
    found = counts(job)
    assert found.get("passed", 0) >= 7 and not found.get("skipped") and not found.get("error"), job.stdout[-3000:]
    assert list((tmp_path / ".cache" / "megatron-npu" / "wheels").glob("torch_npu-*.whl")), "the wheel was not cached"


def test_the_fast_lane_passes_with_nothing_cached(tmp_path):
    job = pytest_in_an_empty_home(tmp_path, "-m", "not launch", "tests")
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-2000:]
    assert "not verified in this run:" in job.stdout  # the closing line names the skipped contract tests
    assert not (tmp_path / ".cache" / "megatron-npu").exists(), "the fast lane fetched something"
