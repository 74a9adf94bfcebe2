"""The transformer-layer ModuleSpec of pretrain_gpt.py: where a backend plugs in.

megatron-core's local spec (its own linear layers and MLP; no Transformer Engine) with
the norm and core attention of megatron_npu.ops.spec_provider.DeviceSpecProvider, the
backend seam megatron-core's TE spec uses: a sequence-parallel-capable norm (the device's
fused RMSNorm where there is one), the SwiGLU activation on the device's kernel, and, with
``--use-flash-attn`` on a device with a fused attention kernel, FusedDotProductAttention.
"""

from __future__ import annotations

import argparse

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_npu.ops.spec_provider import DeviceSpecProvider


def spec_provider(args: argparse.Namespace) -> DeviceSpecProvider:
    return DeviceSpecProvider(use_flash_attn=bool(args.use_flash_attn))


def uses_fused_attention(args: argparse.Namespace) -> bool:
    return spec_provider(args).fused_attention()


def gpt_layer_spec(args: argparse.Namespace) -> ModuleSpec:
    backend = spec_provider(args)
    spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    layer = spec.submodules
    norm = backend.layer_norm(rms_norm=args.normalization == "RMSNorm")
    layer.input_layernorm = layer.pre_mlp_layernorm = norm
    attention = layer.self_attention.submodules
    attention.core_attention = backend.core_attention()
    if args.qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = backend.layer_norm(for_qk=True)
    # Built only when config.use_te_activation_func is set (training/config.py: device SwiGLU).
    layer.mlp.submodules.activation_func = backend.activation_func()
    return spec
