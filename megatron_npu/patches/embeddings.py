"""Rotary embeddings: megatron-core's YaRN RoPE built on a host target.

``YarnRotaryEmbedding.__init__`` (multi-latent attention with ``--rotary-scaling-factor``: DeepSeek-V2/V3/R1,
Kimi-K2) opens ``with torch.device(torch.cuda.current_device())``: a bare device index, which torch resolves
against its current accelerator. torch_npu registers itself as that accelerator, so on npu the index names the
NPU; on a host target (CPU torch) torch has none and raises "Cannot access accelerator device when none is
available" while MLASelfAttention is built. The embedding's own ``use_cpu_initialization`` path builds the same
tensors on the host, which there is the device.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "embeddings"


@register(
    "YarnRotaryEmbedding.__init__.host_device",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding:YarnRotaryEmbedding.__init__",
    reason="opens `with torch.device(torch.cuda.current_device())`, a bare index torch resolves against its "
    "accelerator, which a host target lacks (RuntimeError building MLASelfAttention with YaRN); the host is the "
    "device there, so the embedding's own use_cpu_initialization path builds the same tensors",
    subsystem=SUBSYSTEM,
    # 0.15.3 ... 0.19.2 open the device context with the same signature; 0.12-0.14 pass device= to each factory
    # (mapped by device_arguments.py)
    megatron_versions=">=0.15.0,<0.20",
    requires="runs_on_host",
)
def _yarn_init(original: Callable[..., None], accelerator: Accelerator) -> Callable[..., None]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["use_cpu_initialization"] = True
        original(*bound.args, **bound.kwargs)

    return __init__
