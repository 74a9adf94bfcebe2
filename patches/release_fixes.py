"""Faults of particular megatron-core releases without Transformer Engine (CPU torch, torch_npu).

Each patch here applies only to the releases it names: a later release fixed the fault upstream.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "release_fixes"


@register(
    "fp8_utils.quantize_param_shard.no_fp8_params",
    "megatron.core.fp8_utils:quantize_param_shard",
    reason="0.12.x: the distributed optimizer casts its fp8 params after every step, and without Transformer "
    "Engine the cast raises 'Invalid Transformer Engine version' even when there are no fp8 params (0.13 "
    "returns early on an empty list): the same early return",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.12.0,<0.13",
)
def _quantize_param_shard(original: Callable[..., None], accelerator: Accelerator) -> Callable[..., None]:
    @functools.wraps(original)
    def quantize_param_shard(model_params: list, *args: Any, **kwargs: Any) -> None:
        if len(model_params) == 0:
            return None
        return original(model_params, *args, **kwargs)

    return quantize_param_shard
