"""``megatron.core.parallel_state``, whose stage tests take ``vp_stage`` on every supported release.

``is_pipeline_first_stage`` / ``is_pipeline_last_stage(ignore_virtual, vp_stage)``: 0.13+; 0.12's take
``ignore_virtual`` only (see core.call_with_vp_stage). Every other name is megatron-core's own, looked up when
used (module ``__getattr__``), so ``from megatron_npu.compat import parallel_state`` reads as the original.
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_npu.compat.core import call_with_vp_stage


def _core() -> Any:
    return importlib.import_module("megatron.core.parallel_state")


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    return call_with_vp_stage(_core().is_pipeline_first_stage, ignore_virtual=ignore_virtual, vp_stage=vp_stage)


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    return call_with_vp_stage(_core().is_pipeline_last_stage, ignore_virtual=ignore_virtual, vp_stage=vp_stage)


def __getattr__(name: str) -> Any:
    return getattr(_core(), name)
