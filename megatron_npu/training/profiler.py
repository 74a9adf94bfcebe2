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
    iterations [profile_step_start, profile_step_end) on ``--profile-ranks``, into LOG_DIR/profile/:
    a Chrome trace per rank (chrome://tracing, Perfetto), or on Ascend torch_npu's output per rank,
    which MindStudio Insight and msprof-analyze read. Validation refuses --profile without a log dir."""

    def __init__(self, profiling: ProfilingSection, log_dir: str | None):
        self.enabled = profiling.profile and dist.get_rank() in profiling.profile_ranks and log_dir is not None
        self.start, self.end = profiling.profile_step_start, profiling.profile_step_end
        self.name = f"rank{dist.get_rank():05d}"
        self.trace_dir = os.path.join(log_dir or ".", "profile")
        self.path = os.path.join(self.trace_dir, f"{self.name}.json")
        self._profiler: Any = None

    def before(self, iteration: int) -> None:
        if self.enabled and iteration == self.start:
            os.makedirs(self.trace_dir, exist_ok=True)
            self._profiler = get_accelerator().profiler(self.trace_dir, self.name)
            self._profiler.__enter__()

    def after(self, iteration: int) -> None:
        if self._profiler is not None and iteration == self.end - 1:
            self._profiler.__exit__(None, None, None)  # a tool's own output is written here, when it stops
            written = get_accelerator().profiler_output
            if written == "chrome":
                self._profiler.export_chrome_trace(self.path)
            self._profiler = None
            where = self.path if written == "chrome" else f"{self.trace_dir}/{self.name}_*  (for {written})"
            print_rank_0(f"  profiler trace of iterations {self.start}..{self.end - 1} written to {where}")
