"""Core attention on the device's fused flash-attention kernel (``--use-flash-attn``).

A drop-in for megatron-core's ``DotProductAttention`` in the layer spec: the device's fused
flash-attention kernel for what it expresses (``FUSED_ATTENTION_COVERS``): causal self-attention,
an explicit attention mask (document masks of ``--reset-attention-mask``), sliding windows
(``--window-size``), different q/k and v head sizes (MLA), grouped query heads; otherwise (sinks of
``--softmax-type``, attention bias, packed sequences, context parallel, query-key layer scaling),
or where the device has no kernel, megatron-core's own unfused attention (``FUSED_ATTENTION_FALLS_BACK``).
"""

from __future__ import annotations

from typing import Any

from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_npu.accelerator import get_accelerator
from megatron_npu.compat.core import layer_window
from megatron_npu.ops import fused

#: what the fused path runs (the doctor lists both)
FUSED_ATTENTION_COVERS = (
    "causal self-attention",
    "document masks (--reset-attention-mask)",
    "sliding windows (--window-size)",
    "different q/k and v head sizes (multi-latent attention)",
    "grouped query attention",
    "under --context-parallel-size: the ring's blocks (npu_fusion_attention / _grad; a block the window cuts "
    "as its band, sparse_mode 4) and merges (npu_ring_attention_update), attention sinks as one more merge",
)
#: what falls back to megatron-core's unfused math under --use-flash-attn, and why
FUSED_ATTENTION_FALLS_BACK = {
    "--softmax-type off-by-one / learnable (attention sinks)": (
        "torch_npu 2.14.0's npu_fusion_attention has a sink argument its documented prototype lacks; "
        "unused until checked on hardware"
    ),
    "--apply-query-key-layer-scaling": "the kernel scales once, megatron-core per layer in fp32",
    "attention bias / packed sequences": "not passed by this trainer's GPT path",
}


class FusedDotProductAttention(DotProductAttention):
    """megatron-core's DotProductAttention (MLA's head sizes: megatron_npu/patches/attention.py) on the
    device's fused kernel where it expresses the call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window_size = layer_window(self.config, self.layer_number)

    def _fused_path(self, attn_mask_type: Any, attention_bias: Any, packed_seq_params: Any) -> bool:
        return (
            get_accelerator().fused_kernel("flash_attention") is not None
            and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            and attention_bias is None
            and packed_seq_params is None
            and self.config.context_parallel_size == 1
            and not self.config.apply_query_key_layer_scaling
            and self.softmax_offset is None  # sinks: the kernel has no input for them
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
        # As megatron-core's softmax: a window layer masks by its window alone (the mask it is given is
        # replaced); otherwise the given mask (document masks) or, when none, the causal one.
        mask = None if self.window_size is not None else attention_mask
        # Dropout masks differ across TP ranks exactly as in megatron's unfused path.
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return fused.flash_attention(
                query,
                key,
                value,
                softmax_scale=self.softmax_scale,
                dropout_p=dropout_p,
                attention_mask=mask,
                window=self.window_size,
            )
