"""Core attention on the device's fused flash-attention kernel (``--use-flash-attn``).

A drop-in for megatron-core's ``DotProductAttention`` in the layer spec. It takes the
fused path for what the kernel covers (causal self-attention, no attention bias, no
packed sequences, no context parallel, no query-key layer scaling) and otherwise, or
where the device has no kernel, runs megatron-core's own unfused attention.
"""

from __future__ import annotations

from typing import Any

from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_npu.accelerator import get_accelerator
from megatron_npu.ops import fused


class FusedDotProductAttention(DotProductAttention):
    def _fused_path(self, attn_mask_type: Any, attention_bias: Any, packed_seq_params: Any) -> bool:
        return (
            get_accelerator().fused_kernel("flash_attention") is not None
            and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            and attention_bias is None
            and packed_seq_params is None
            and self.config.context_parallel_size == 1
            and not self.config.apply_query_key_layer_scaling
        )

    def forward(
        self,
        query: Any,
        key: Any,
        value: Any,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> Any:
        if not self._fused_path(attn_mask_type, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        dropout_p = self.attention_dropout.p if self.training else 0.0
        # Dropout masks differ across TP ranks exactly as in megatron's unfused path.
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return fused.flash_attention(query, key, value, softmax_scale=self.softmax_scale, dropout_p=dropout_p)
