"""What changes during a run, in one object: the settings (``get_args()``) are read-only once
validated, and everything the loop advances lives here, with the ``state_dict()`` a checkpoint
carries and a resume restores (as torchtitan's trainer keeps its step counters apart from its
job config)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class RunState:
    """The run's counters. Megatron-LM keeps these in ``args`` (iteration, consumed_train_samples,
    consumed_valid_samples, ...); here they are one object the loop, the checkpointer and the
    reports share."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0  # the optimizer skipped the step (fp16 loss-scale overflow)
    nan_iterations: int = 0  # a reported loss was NaN or Inf
    floating_point_operations_so_far: float = 0.0
    exit_reason: str | None = None  # set when an exit condition ends the loop

    # Counters a checkpoint restores; the exit reason belongs to one process's run only.
    _SAVED = (
        "iteration",
        "consumed_train_samples",
        "consumed_valid_samples",
        "skipped_iterations",
        "nan_iterations",
        "floating_point_operations_so_far",
    )

    def count_step(self, global_batch_size: int, *, updated: bool, finite: bool) -> None:
        """One finished optimizer step: its samples, and whether it was skipped or non-finite."""
        self.consumed_train_samples += global_batch_size
        self.skipped_iterations += 0 if updated else 1
        self.nan_iterations += 0 if finite else 1

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._SAVED}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the saved counters; ones an older checkpoint lacks keep their defaults."""
        for name in self._SAVED:
            if name in state:
                setattr(self, name, type(getattr(self, name))(state[name]))
