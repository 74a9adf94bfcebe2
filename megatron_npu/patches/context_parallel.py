"""Context parallelism for megatron-core's local (no Transformer Engine) layer spec.

Megatron-LM's own trainer with ``--transformer-impl local`` builds its layers from
``get_gpt_layer_local_spec``, whose backend (``LocalSpecProvider``) hands out
``DotProductAttention``: it asserts ``context_parallel_size == 1`` ("only supported by
TEDotProductAttention"). With CP > 1 the backend hands out megatron_npu's
``ContextParallelAttention`` instead (ring, all-to-all or both, per ``--cp-comm-type``); the rest
of megatron-core's CP plumbing is used as it is.

And megatron-core 0.16's ``TransformerLayer`` reads a per-layer ``cp_comm_type`` list (Megatron-LM's
``--cp-comm-type p2p a2a ...``, one per layer) with its 1-based layer number: every layer takes the
next layer's type and the last one raises IndexError.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "context_parallel"
VERIFIED = ">=0.16.0,<0.17"  # read and tested on megatron-core 0.16.1


def _context_parallel_size() -> int:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_context_parallel_world_size()


@register(
    "backends.LocalSpecProvider.core_attention.context_parallel",
    "megatron.core.models.backends:LocalSpecProvider.core_attention",
    reason="the local spec's DotProductAttention asserts context_parallel_size == 1 (CP only with Transformer "
    "Engine); with CP > 1 the local spec gets megatron_npu's ring / all-to-all ContextParallelAttention",
    subsystem=SUBSYSTEM,
    megatron_versions=VERIFIED,
)
def _local_core_attention(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def core_attention(self: Any) -> type:
        if _context_parallel_size() > 1:
            from megatron_npu.ops.context_parallel import ContextParallelAttention

            return ContextParallelAttention
        return original(self)

    return core_attention


@register(
    "transformer_layer.TransformerLayer.__init__.cp_comm_type_per_layer",
    "megatron.core.transformer.transformer_layer:TransformerLayer.__init__",
    reason="indexes a per-layer cp_comm_type list with the 1-based layer number (layer L gets layer L+1's type, "
    "the last layer IndexError); the list is read with the number it was written for",
    subsystem=SUBSYSTEM,
    megatron_versions=VERIFIED,
)
def _per_layer_comm_type(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        per_layer = getattr(config, "cp_comm_type", None)
        if not isinstance(per_layer, list):
            return original(self, config, *args, **kwargs)
        config.cp_comm_type = [None, *per_layer]  # read once, as cp_comm_type[layer_number], in this call
        try:
            return original(self, config, *args, **kwargs)
        finally:
            config.cp_comm_type = per_layer

    return __init__
