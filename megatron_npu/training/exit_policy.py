"""When a run stops before --train-iters: Megatron-LM's exit conditions."""

from __future__ import annotations

import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_npu.accelerator import get_accelerator
from megatron_npu.training.sections import ScheduleSection


def sum_over_world(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=get_accelerator().device())
    dist.all_reduce(tensor)
    return tensor.item()


class ExitSignal:
    """``--exit-signal-handler``, as Megatron-LM's DistributedSignalHandler: SIGTERM (a
    scheduler preempting the job, or torchrun forwarding its own) only sets a flag; after
    each iteration the flags are summed over the world, so every rank saves the same
    iteration and stops. torchrun sends SIGKILL 30 s after it forwards SIGTERM: the
    iteration in flight and the save must fit in that."""

    def __init__(self, enabled: bool, signum: int = signal.SIGTERM) -> None:
        self.enabled, self.signum, self.received = enabled, signum, False
        self._previous: Any = None

    def install(self) -> ExitSignal:
        if self.enabled:
            self._previous = signal.signal(self.signum, self._handle)
        return self

    def restore(self) -> None:
        if self.enabled:
            signal.signal(self.signum, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True

    def any_rank_received(self) -> bool:
        return self.enabled and sum_over_world(float(self.received)) > 0


class ExitPolicy:
    """Megatron-LM's exit conditions (a signal, --exit-interval, --exit-duration-in-mins), decided
    alike on every rank after each iteration."""

    def __init__(self, schedule: ScheduleSection) -> None:
        self.schedule = schedule
        self.start_time = time.time()
        self.signal = ExitSignal(schedule.exit_signal_handler, schedule.exit_signal)

    def __enter__(self) -> ExitPolicy:
        self.signal.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.signal.restore()

    def reason(self, iteration: int) -> str | None:
        """Why the run stops after ``iteration``, or None to go on."""
        args = self.schedule
        if self.signal.any_rank_received():
            return f"after receiving {signal.Signals(self.signal.signum).name} at iteration {iteration}"
        if args.exit_interval and iteration % args.exit_interval == 0:
            return f"at iteration {iteration} (--exit-interval {args.exit_interval})"
        if args.exit_duration_in_mins:
            over = (time.time() - self.start_time) / 60.0 > args.exit_duration_in_mins
            if sum_over_world(float(over)) > 0:  # every rank stops at the same iteration
                return f"after {args.exit_duration_in_mins} minutes at iteration {iteration} (--exit-duration-in-mins)"
        return None
