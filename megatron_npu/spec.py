"""The transformer-layer ModuleSpec of pretrain_gpt.py: where a backend plugs in.

megatron-core's local spec (its own attention, MLP and norms; no Transformer
Engine). Its norm is rebound by the patch layer to a sequence-parallel-capable
torch norm (patches/transformer.py), which runs the device's fused RMSNorm where
there is one. With ``--use-flash-attn`` on a device with a fused attention kernel,
core attention becomes megatron_npu.ops.attention.FusedDotProductAttention.
"""

from __future__ import annotations

import argparse

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_npu.accelerator import get_accelerator


def uses_fused_attention(args: argparse.Namespace) -> bool:
    return bool(args.use_flash_attn) and get_accelerator().fused_ops()["flash_attention"]


def gpt_layer_spec(args: argparse.Namespace) -> ModuleSpec:
    spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    if uses_fused_attention(args):
        from megatron_npu.ops.attention import FusedDotProductAttention

        spec.submodules.self_attention.submodules.core_attention = FusedDotProductAttention
    return spec
