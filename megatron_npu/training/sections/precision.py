"""The mixed-precision section: the training dtype and where fp32 is kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import Section, spec


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionSection(Section):
    """The training dtype and the fp32 islands (Megatron-LM's mixed precision group)."""

    fp16: bool = False
    """Run model in fp16 mode."""

    bf16: bool = False
    """Run model in bfloat16 mode."""

    grad_reduce_in_bf16: bool = False
    """Reduce gradients in bfloat16."""

    fp32_residual_connection: bool = False
    """Move residual connections to fp32."""

    apply_query_key_layer_scaling: bool = False
    """Scale Q * K^T by 1 / layer-number (numeric stability in fp16; sets --attention-softmax-in-fp32)."""

    attention_softmax_in_fp32: bool = False
    """Run attention masking and softmax in fp32."""

    accumulate_allreduce_grads_in_fp32: bool = False
    """Gradient accumulation and all-reduce in fp32."""

    fp16_lm_cross_entropy: bool = False
    """Compute the LM head's unreduced cross-entropy loss in fp16."""

    params_dtype: Literal["float32", "float16", "bfloat16"] = spec("float32", derived=True)
    """The parameters' dtype, from --fp16 / --bf16 (validation derives it; no flag)."""
