"""The misc section: where the argument values may also come from (--yaml-cfg)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Section


@dataclass(frozen=True, kw_only=True)
class MiscSection(Section):
    """Argument values from a file (Megatron-LM's experimental --yaml-cfg)."""

    yaml_cfg: str | None = None
    """YAML file of argument values (keys: dests or flag names without dashes, flat or in sections); explicit
    command-line flags win over it."""
