"""Core attention: megatron-core's local DotProductAttention built by multi-latent attention.

``MLASelfAttention`` builds its core attention with the query/key and value head sizes of MLA
(``k_channels=q_head_dim, v_channels=v_head_dim``), which only Transformer Engine's DotProductAttention takes;
the local spec's (``--transformer-impl local``, ``get_gpt_layer_local_spec(multi_latent_attention=True)``) has no
such arguments: TypeError building every MLA model without TE, on every device (a megatron-core defect,
0.12-0.19). The math reads both head sizes from the tensors; what the module derives from ``kv_channels`` is
corrected: the context's width (value heads) and, where MLA gives no softmax scale, the default scale (the
query/key head size), as megatron-core derives it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "attention"


@register(
    "DotProductAttention.__init__.mla_head_sizes",
    "megatron.core.transformer.dot_product_attention:DotProductAttention.__init__",
    reason="MLASelfAttention passes k_channels / v_channels (MLA's q/k and v head sizes), which only Transformer "
    "Engine's attention takes: the local spec's DotProductAttention raises TypeError (a megatron-core defect on "
    "every device); taken, with the context width and default softmax scale they set",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.12.0,<0.20",  # the same __init__ derivations (projection_size from kv_channels)
)
def _dot_product_attention_init(original: Callable[..., None], accelerator: Accelerator) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(  # noqa: N807
        self: Any, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any
    ) -> None:
        original(self, *args, **kwargs)
        if v_channels is not None:  # the context is [sq, b, heads * v_channels]
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
            if kwargs.get("softmax_scale") is None:  # MLA passes its own (YaRN's mscale)
                self.softmax_scale = 1.0 / math.sqrt(k_channels)
                if self.config.apply_query_key_layer_scaling:
                    self.softmax_scale /= self.layer_number

    return __init__
