"""megatron-core's config dataclasses built from this trainer's fields, on releases that lack some of them.

The trainer fills every field megatron-core 0.16 has (training/config.py). An older release's dataclass lacks
a few; a field it lacks is left out when its value asks for nothing (off, None) or when the release runs the
same math without it (``FALLBACKS``); any other value is a feature that release cannot honour: ``ReleaseGap``
with one line naming the field, its value and the release.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from megatron_npu.compat.core import gap

T = TypeVar("T")

# field -> why leaving it out keeps the run's math (the release has no such seam)
FALLBACKS = {
    # TransformerConfig.use_te_activation_func (0.15+): the seam that builds a spec'd activation module (the
    # device's fused SwiGLU); before 0.15 the MLP applies config.activation_func itself: the same SwiGLU, unfused
    "use_te_activation_func": "the MLP's activation runs as torch math",
}


def release_config(cls: type[T], values: dict[str, Any]) -> T:
    """``cls(**values)``, less the fields this release's ``cls`` lacks (see the module docstring)."""
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    for name in sorted(set(values) - known):
        value = values[name]
        if value is None or value is False or name in FALLBACKS:
            continue
        raise gap(f"{cls.__name__}.{name} (set to {value!r})", "turn off the flag that sets it, or use a later release")
    return cls(**{name: value for name, value in values.items() if name in known})
