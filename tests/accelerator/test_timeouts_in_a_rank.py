"""One timeout setting: the environment a rank sees once its process groups exist.

On npu, HCCL_EXEC_TIMEOUT and HCCL_CONNECT_TIMEOUT follow --distributed-timeout-minutes where the
user did not export them (megatron_npu/patches/distributed.py, the accelerator's decision). Checked
through the trainer's start-up under torchrun on the cpu target, with the npu target's decision
emulated (tests/fixtures/timeout_worker.py); and what `megatron-npu doctor` prints.
"""

from datetime import timedelta

import pytest
from distributed import ROOT, base_env, torchrun
from pretrain_runs import MOCK_DATA, SHAPE

from megatron_npu.accelerator.cpu import CpuAccelerator
from megatron_npu.accelerator.npu import NpuAccelerator
from megatron_npu.doctor import collective_timeouts, render_timeouts


@pytest.mark.launch
def test_a_rank_sees_hccl_timeouts_from_the_flag_and_keeps_the_exported_one():
    env = base_env(MEGATRON_NPU_AUTOPATCH="0", HCCL_CONNECT_TIMEOUT="1800")
    env.pop("HCCL_EXEC_TIMEOUT", None)
    flags = [*SHAPE, *MOCK_DATA, "--lr", "1e-3", "--train-iters", "1", "--distributed-timeout-minutes", "3"]
    job = torchrun(ROOT / "tests" / "fixtures" / "timeout_worker.py", *flags, nproc=2, env=env).check()
    ranks = job.by_rank()
    assert sorted(ranks) == [0, 1]
    for result in ranks.values():
        # 3 minutes for a stuck collective; the link set-up time the user exported is kept
        assert result["environment"] == {"HCCL_EXEC_TIMEOUT": "180", "HCCL_CONNECT_TIMEOUT": "1800"}
        assert result["doctor"] == result["environment"]  # the doctor said what the rank got


def _npu() -> NpuAccelerator:
    return object.__new__(NpuAccelerator)  # the decision reads no device state: no torch_npu needed


def test_the_doctor_prints_the_timeouts_in_force():
    line = render_timeouts(collective_timeouts(_npu(), 10, {}))
    assert "HCCL_EXEC_TIMEOUT=600 s (from --distributed-timeout-minutes 10)" in line
    assert "HCCL_CONNECT_TIMEOUT=600 s (from --distributed-timeout-minutes 10)" in line
    exported = collective_timeouts(_npu(), 240, {"HCCL_EXEC_TIMEOUT": "1836"})["variables"]
    assert exported["HCCL_EXEC_TIMEOUT"] == {"value": "1836", "source": "exported"}
    assert exported["HCCL_CONNECT_TIMEOUT"] == {"value": "7200", "source": "flag"}  # CANN's [120, 7200]
    assert collective_timeouts(CpuAccelerator(), 10, {})["variables"] == {}
    assert _npu().collective_timeout_environment(timedelta(minutes=240), {})["HCCL_EXEC_TIMEOUT"] == "14400"
