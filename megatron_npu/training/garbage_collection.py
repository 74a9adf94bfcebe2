"""Megatron-LM's manual garbage collection (``--manual-gc``): Python's threshold-triggered collector off,
a full collection at start-up and every ``--manual-gc-interval`` steps, and around each evaluation
(``--manual-gc-eval``, on by default).

Why: a threshold collection falls at a different moment on each rank, and one rank's pause stalls every
collective; on a large model a full collection takes a second or more, and one landing inside a step or a
checkpoint save (measured: 1.15 s of an asynchronous save's 1.42 s first stall) is time every rank waits
for. Collecting at the same iterations on all ranks keeps the pauses aligned and out of the saves.
"""

from __future__ import annotations

import gc
from types import TracebackType

from megatron_npu.training.sections import TrainingSection


class GarbageCollection:
    """Where the collector runs during training: a context manager over the loop."""

    def __init__(self, training: TrainingSection) -> None:
        self.manual = training.manual_gc
        self.interval = training.manual_gc_interval
        self.around_evaluation = training.manual_gc_eval
        self._was_enabled = False  # the collector's state when the loop began (__enter__, under --manual-gc)

    def __enter__(self) -> GarbageCollection:
        if self.manual:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        # Megatron-LM leaves the collector off; the process may go on (tests, an in-process caller)
        if self.manual and self._was_enabled:
            gc.enable()

    def after_step(self, iteration: int) -> None:
        if self.manual and self.interval and iteration % self.interval == 0:
            gc.collect()

    def before_evaluation(self) -> None:
        if self.manual and self.around_evaluation:
            gc.collect()

    def after_evaluation(self) -> None:
        # only what the evaluation made and dropped: the youngest generation, as Megatron-LM does
        if self.manual and self.around_evaluation:
            gc.collect(generation=0)
