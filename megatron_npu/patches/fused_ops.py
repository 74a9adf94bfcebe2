"""Fused ops: megatron-core's fused-RoPE slot filled with the device's rotary kernel.

The one fusion with no spec seam (norm, core attention and the SwiGLU activation go
through megatron_npu.ops.spec_provider). megatron-core calls its fused RoPE
(``rope_utils.fused_apply_rotary_pos_emb``, Transformer Engine's, None without it) only
when ``config.apply_rope_fusion`` is set, so ``--no-rope-fusion`` runs megatron's unfused
math on every target. The kernel is the accelerator's (``fused_kernel("rotary")``, a
neutral signature; its torch twin is megatron_npu/ops/fused.py's ``rotary``). Applied
by capability: a target without the kernel keeps megatron-core as it is.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.ops import fused
from megatron_npu.registry import register

SUBSYSTEM = "fused_ops"
ROPE = "megatron.core.models.common.embeddings.rope_utils"


@register(
    "rope_utils.fused_apply_rotary_pos_emb.device_kernel",
    f"{ROPE}:fused_apply_rotary_pos_emb",
    reason="megatron's fused-RoPE slot is Transformer Engine's kernel (None without TE): the device's rotary "
    "kernel fills it, so config.apply_rope_fusion (--no-rope-fusion) decides, as on CUDA",
    subsystem=SUBSYSTEM,
    requires="has_fused_rotary",
)
def _rotary(original: Callable | None, accelerator: Accelerator) -> Callable:
    # No spec seam exists for RoPE (SelfAttention applies it before core attention); megatron's
    # apply_rotary_pos_emb calls this slot only when config.apply_rope_fusion is set.
    unfused = importlib.import_module(ROPE)._apply_rotary_pos_emb_bshd

    def fused_apply_rotary_pos_emb(
        t: Any, freqs: Any, transpose_output_memory: bool = False, interleaved: bool = False
    ) -> Any:
        if original is not None:  # Transformer Engine is installed: its kernel stays
            return original(t, freqs, transpose_output_memory=transpose_output_memory, interleaved=interleaved)
        if not fused.fused_rotary_serves(interleaved):
            return unfused(t, freqs, rotary_interleaved=True)
        return fused.rotary(t, freqs)

    return fused_apply_rotary_pos_emb
