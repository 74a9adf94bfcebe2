"""Fused ops: megatron-core's unfused rotary embedding and SwiGLU on torch_npu's kernels.

Without Transformer Engine megatron-core computes RoPE and SwiGLU with several
elementwise torch ops each; torch_npu has one fused kernel for each
(``npu_rotary_mul``, ``npu_swiglu``). The math is the same (megatron_npu/ops/fused.py
has both sides). RMSNorm needs no patch: the SP-capable norm of patches/transformer.py
builds megatron_npu.ops.fused.RMSNorm. npu only: on cuda the upstream path stays, on
cpu there is no kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.ops import fused
from megatron_npu.registry import register

SUBSYSTEM = "fused_ops"
ROPE = "megatron.core.models.common.embeddings.rope_utils"


@register(
    "rope_utils._apply_rotary_pos_emb_bshd.fused",
    f"{ROPE}:_apply_rotary_pos_emb_bshd",
    reason="RoPE (bshd, half-split) on the device's fused rotary kernel instead of 6 elementwise ops",
    subsystem=SUBSYSTEM,
    requires="has_fused_kernels",
)
def _rotary(original: Callable, accelerator: Accelerator) -> Callable:
    if not accelerator.fused_ops().get("rotary"):
        return original

    @functools.wraps(original)
    def _apply_rotary_pos_emb_bshd(
        t: Any, freqs: Any, rotary_interleaved: bool = False, multi_latent_attention: bool = False, mscale: float = 1.0
    ) -> Any:
        if rotary_interleaved or multi_latent_attention or mscale != 1.0:
            return original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        return fused.rotary(t, freqs)

    return _apply_rotary_pos_emb_bshd


@register(
    "fused_bias_swiglu.bias_swiglu_impl.fused",
    "megatron.core.fusions.fused_bias_swiglu:bias_swiglu_impl",
    reason="SwiGLU on the device's fused kernel; the TorchScript fusion has no npu backend",
    subsystem=SUBSYSTEM,
    requires="has_fused_kernels",
)
def _swiglu(original: Callable, accelerator: Accelerator) -> Callable:
    if not accelerator.fused_ops().get("swiglu"):
        return original

    @functools.wraps(original)
    def bias_swiglu_impl(input: Any, bias: Any, fp8_input_store: bool = False, cpu_offload_input: bool = False) -> Any:  # noqa: A002
        if fp8_input_store or cpu_offload_input:
            return original(input, bias, fp8_input_store, cpu_offload_input)
        return fused.swiglu(input if bias is None else input + bias)

    return bias_swiglu_impl
