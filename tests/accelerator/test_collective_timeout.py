"""--distributed-timeout-minutes bounds every wait on a dead peer, the collective library's own too.

On npu, HCCL waits on a stuck collective for HCCL_EXEC_TIMEOUT (default 1836 s) and on a peer that
never connects for HCCL_CONNECT_TIMEOUT (default 120 s), whatever the process group's timeout. The
patched init_process_group sets both from the timeout it is given, unless the user set them.
"""

import os
from datetime import timedelta

import pytest

from megatron_npu.accelerator.cpu import CpuAccelerator
from megatron_npu.accelerator.npu import NpuAccelerator
from megatron_npu.patches.distributed import _positional_backend


def npu_timeout_environment(minutes: float, environ: dict[str, str] | None = None) -> dict[str, str]:
    # the mapping reads no device state: checked without torch_npu (it needs CANN to import)
    npu = object.__new__(NpuAccelerator)
    return npu.collective_timeout_environment(timedelta(minutes=minutes), environ or {})


def test_hccl_timeouts_follow_the_process_group_timeout():
    assert npu_timeout_environment(10) == {"HCCL_EXEC_TIMEOUT": "600", "HCCL_CONNECT_TIMEOUT": "600"}


def test_hccl_link_set_up_timeout_stays_in_its_documented_range():
    assert npu_timeout_environment(1)["HCCL_CONNECT_TIMEOUT"] == "120"
    assert npu_timeout_environment(1)["HCCL_EXEC_TIMEOUT"] == "60"
    assert npu_timeout_environment(600)["HCCL_CONNECT_TIMEOUT"] == "7200"
    assert npu_timeout_environment(600)["HCCL_EXEC_TIMEOUT"] == "36000"


def test_hccl_timeouts_the_user_exported_are_kept():
    assert npu_timeout_environment(10, {"HCCL_EXEC_TIMEOUT": "1836"}) == {"HCCL_CONNECT_TIMEOUT": "600"}


def test_targets_whose_process_group_applies_the_timeout_itself_set_nothing():
    assert CpuAccelerator().collective_timeout_environment(timedelta(minutes=10), {}) == {}


class _TimeoutNamingTarget(CpuAccelerator):
    """A cpu target whose collective library reads its timeout from the environment."""

    def collective_timeout_environment(self, timeout, environ):
        return {} if "LIB_TIMEOUT" in environ else {"LIB_TIMEOUT": str(int(timeout.total_seconds()))}


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda init: init("nccl", timeout=timedelta(minutes=3)), id="keyword"),
        pytest.param(lambda init: init("nccl", "env://", timedelta(minutes=3)), id="positional"),
    ],
)
def test_init_process_group_sets_the_librarys_timeout_before_the_group_exists(call, monkeypatch):
    monkeypatch.delenv("LIB_TIMEOUT", raising=False)
    seen = {}

    def original(*args, **kwargs):
        seen.update(backend=kwargs["backend"], environment=os.environ.get("LIB_TIMEOUT"))

    call(_positional_backend(original, _TimeoutNamingTarget()))
    assert seen == {"backend": "gloo", "environment": "180"}
    monkeypatch.delenv("LIB_TIMEOUT")


def test_init_process_group_without_a_timeout_leaves_the_librarys_default(monkeypatch):
    monkeypatch.delenv("LIB_TIMEOUT", raising=False)
    _positional_backend(lambda *args, **kwargs: None, _TimeoutNamingTarget())("nccl")
    assert "LIB_TIMEOUT" not in os.environ
