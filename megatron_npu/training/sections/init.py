"""The initialization section: the random seed and whether data-parallel replicas start apart."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Section


@dataclass(frozen=True, kw_only=True)
class InitSection(Section):
    """The random seed (Megatron-LM's initialization group; RNGConfig)."""

    seed: int = 1234
    """Random seed used for python, numpy, pytorch, and the device."""

    data_parallel_random_init: bool = False
    """Enable random initialization of params across data parallel ranks."""
