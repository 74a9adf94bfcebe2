"""The profiling section: --profile's window and ranks, the allocator history, the memory report."""

from __future__ import annotations

from dataclasses import dataclass

from ...fates import NO_HISTORY, FlagPolicy
from .base import Section, spec


@dataclass(frozen=True, kw_only=True)
class ProfilingSection(Section):
    """--profile's window and ranks, the memory history and the memory report (Megatron-LM's ProfilingConfig)."""

    profile: bool = False
    """Enable profiling between the profile steps."""

    profile_step_start: int = 10
    """Global step to start profiling."""

    profile_step_end: int = 12
    """Global step to stop profiling."""

    use_pytorch_profiler: bool = False
    """Use the built-in pytorch profiler."""

    profile_ranks: tuple[int, ...] = (0,)
    """Global ranks to profile."""

    record_memory_history: bool = spec(False, fates=(FlagPolicy("--record-memory-history", "ignored", NO_HISTORY),))
    """Record memory history in last rank."""

    memory_snapshot_path: str = spec(
        "snapshot.pickle", fates=(FlagPolicy("--memory-snapshot-path", "ignored", NO_HISTORY),)
    )
    """Specifies where to dump the memory history pickle."""

    memory_report: bool = spec(False, extension=True)
    """write each rank's measured bytes (params, grads, optimizer, saved activations) of the first step, with the
    memory model's prediction, to LOG_DIR/memory/
    """
