"""The run's settings: Megatron-LM's argument namespace, validated once, read-only after start-up.

Megatron-LM keeps flags, derived values and the run's counters in one mutable ``args``; here the
flags and what validation derives from them are ``Settings`` (``get_args()`` returns it, so
Megatron-LM-style code reads ``args.<dest>`` unchanged), frozen before the first process group
exists, and every value that changes during the run lives in ``RunState`` (run_state.py). The
layout and the model's shape are typed members owning their rules: ``settings.parallel``
(``ParallelDims``: degrees, micro-batches, interleaving) and ``settings.model_shape``
(``ModelShape``); the flags themselves are typed, frozen sections (``sections/``) that components
take instead of the namespace: ``settings.model``, ``.data``, ``.optim``, ``.schedule``, ``.checkpoint``,
``.logging``, ``.profiling``, ``.moe``, ``.precision``, ``.distributed``, ``.training``, ``.init``,
``.tokenizer``, ``.misc``, ``.fsdp`` (``SECTION_TYPES``), built by validation from the validated values.
Every flag is a field of one section, but ``sections.ReplacedFlags`` (validation removes them) and the
flags accepted without effect (``policy.NO_EFFECT_ARGS``, one declared table: nothing reads them).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from .sections import (
    CheckpointSection,
    DataSection,
    DistributedSection,
    FsdpSection,
    InitSection,
    LoggingSection,
    MiscSection,
    MixedPrecisionSection,
    ModelSection,
    MoeSection,
    OptimizerSection,
    ProfilingSection,
    ScheduleSection,
    Section,
    TokenizerSection,
    TrainingSection,
)

if TYPE_CHECKING:
    from ..layout.model_shape import ModelShape
    from ..layout.parallel_dims import ParallelDims


class FrozenSettingsError(AttributeError):
    """A write to the settings after start-up: run state belongs in RunState."""


class Settings(argparse.Namespace):
    """argparse's namespace with a ``freeze()``; after it, setting or deleting raises."""

    parallel: ParallelDims
    model_shape: ModelShape
    model: ModelSection
    data: DataSection
    optim: OptimizerSection  # not ``optimizer``: args.optimizer is Megatron-LM's --optimizer ("adam")
    schedule: ScheduleSection
    checkpoint: CheckpointSection
    logging: LoggingSection
    profiling: ProfilingSection
    moe: MoeSection
    precision: MixedPrecisionSection
    distributed: DistributedSection
    training: TrainingSection
    init: InitSection
    tokenizer: TokenizerSection
    misc: MiscSection
    fsdp: FsdpSection

    def freeze(self) -> Settings:
        object.__setattr__(self, "_frozen", True)
        return self

    @property
    def frozen(self) -> bool:
        return self.__dict__.get("_frozen", False)

    def __setattr__(self, name: str, value: Any) -> None:
        self._refuse_when_frozen(name)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        self._refuse_when_frozen(name)
        super().__delattr__(name)

    def _refuse_when_frozen(self, name: str) -> None:
        if self.frozen:
            raise FrozenSettingsError(
                f"settings are read-only after start-up (tried to set {name!r}); "
                "what changes during a run belongs in megatron_npu.training.run_state.RunState"
            )

    def _get_kwargs(self) -> list[tuple[str, Any]]:  # argparse's repr: the flags, not the lock or typed members
        return [(k, v) for k, v in super()._get_kwargs() if k not in _NOT_FLAGS]

    def values(self) -> dict[str, Any]:
        """Every flag and derived value by Megatron-LM's name (args.json; a checkpoint's ``args``)."""
        return dict(self._get_kwargs())

    def copy(self) -> argparse.Namespace:
        """A plain, writable namespace with the same values (for Megatron-LM's checkpoint ``args``)."""
        return argparse.Namespace(**self.values())


# Not flags: the lock, and the typed members (derived from the flags, rebuilt from them on load).
SECTION_TYPES: dict[str, type[Section]] = {
    "model": ModelSection,
    "data": DataSection,
    "optim": OptimizerSection,
    "schedule": ScheduleSection,
    "checkpoint": CheckpointSection,
    "logging": LoggingSection,
    "profiling": ProfilingSection,
    "moe": MoeSection,
    "precision": MixedPrecisionSection,
    "distributed": DistributedSection,
    "training": TrainingSection,
    "init": InitSection,
    "tokenizer": TokenizerSection,
    "misc": MiscSection,
    "fsdp": FsdpSection,
}
SECTIONS = tuple(SECTION_TYPES)
_NOT_FLAGS = frozenset({"_frozen", "parallel", "model_shape", *SECTIONS})
