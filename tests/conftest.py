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
