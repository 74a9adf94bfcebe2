"""``--profile``: the accelerator's profiler over a window of iterations."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from megatron_npu.accelerator import get_accelerator
from megatron_npu.training.global_vars import print_rank_0
from megatron_npu.training.sections import ProfilingSection


class StepProfiler:
    """``--profile``: the accelerator's profiler (torch.profiler; torch_npu's on npu) over
    iterations [profile_step_start, profile_step_end) on ``--profile-ranks``; a Chrome trace
    per rank in LOG_DIR/profile/ (chrome://tracing, Perfetto)."""

    def __init__(self, profiling: ProfilingSection, log_dir: str | None):
        self.enabled = profiling.profile and dist.get_rank() in profiling.profile_ranks and log_dir is not None
        self.start, self.end = profiling.profile_step_start, profiling.profile_step_end
        self.path = os.path.join(log_dir or ".", "profile", f"rank{dist.get_rank():05d}.json")
        self._profiler: Any = None

    def before(self, iteration: int) -> None:
        if self.enabled and iteration == self.start:
            self._profiler = get_accelerator().profiler()
            self._profiler.__enter__()

    def after(self, iteration: int) -> None:
        if self._profiler is not None and iteration == self.end - 1:
            self._profiler.__exit__(None, None, None)
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._profiler.export_chrome_trace(self.path)
            self._profiler = None
            print_rank_0(f"  profiler trace of iterations {self.start}..{self.end - 1} written to {self.path}")
