"""The transformer-layer ModuleSpec of pretrain_gpt.py: where a backend plugs in.

megatron-core's local spec (its own linear layers and MLP; no Transformer Engine) with
the norm and core attention of megatron_npu.ops.spec_provider.DeviceSpecProvider, the
backend seam megatron-core's TE spec uses: a sequence-parallel-capable norm (the device's
fused RMSNorm where there is one), the SwiGLU activation on the device's kernel, and, with
``--use-flash-attn`` on a device with a fused attention kernel, FusedDotProductAttention; with
``--context-parallel-size`` > 1, ContextParallelAttention (ring, all-to-all or both).
Multi-latent attention is megatron-core's MLASelfAttention (its local spec), multi-token
prediction its MTP block (``get_gpt_mtp_block_spec_for_backend``) on this provider.
"""

from __future__ import annotations

import argparse

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import transformer_block
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_npu.compat.core import mtp_block_spec_for_backend
from megatron_npu.compat.specs import (  # megatron-core's, on every supported release
    get_num_layers_to_build,
    get_transformer_layer_offset,
    mlp_submodules,
    moe_module_spec,
)
from megatron_npu.layout.moe import moe_layer_pattern
from megatron_npu.ops.spec_provider import DeviceSpecProvider
from megatron_npu.training.config import transformer_config


def spec_provider(args: argparse.Namespace) -> DeviceSpecProvider:
    context_parallel = getattr(args, "context_parallel_size", 1) > 1
    return DeviceSpecProvider(use_flash_attn=bool(args.use_flash_attn), context_parallel=context_parallel)


def uses_fused_attention(args: argparse.Namespace) -> bool:
    return spec_provider(args).fused_attention()


def gpt_layer_spec(args: argparse.Namespace, vp_stage: int | None = None) -> ModuleSpec | TransformerBlockSubmodules:
    """The layer spec; with --num-experts or --pipeline-model-parallel-layout, the block spec of this
    pipeline chunk's layers (dense and MoE layers by --moe-layer-freq, as megatron-core's
    get_gpt_decoder_block_spec slices them)."""
    if args.num_experts is None and getattr(args, "pipeline_model_parallel_layout", None) is None:
        return _layer_spec(args)
    config = transformer_config(args)
    specs = decoder_layer_specs(args)
    layout = getattr(config, "pipeline_model_parallel_layout", None)  # a field of megatron-core 0.14+
    if layout is not None:  # a pipeline layout string (megatron-core 0.14+: older releases refuse the field)
        from megatron.core.transformer.enums import LayerType

        ids = layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage)
        local = [specs[i] for i in ids]
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        local = specs[offset : offset + get_num_layers_to_build(config, vp_stage=vp_stage)]
    # the final norm megatron-core's TransformerBlock gives a plain layer spec (read at call time: patched)
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=transformer_block.LayerNormImpl)


def decoder_layer_specs(args: argparse.Namespace) -> list[ModuleSpec]:
    """Every decoder layer's spec, in order (megatron-core's get_gpt_decoder_layer_specs)."""
    dense = _layer_spec(args)
    if args.num_experts is None:
        return [dense] * args.num_layers
    moe = _layer_spec(args)
    moe.submodules.mlp = moe_module_spec(spec_provider(args), args.num_experts, args.moe_grouped_gemm)
    return [moe if is_moe else dense for is_moe in moe_layer_pattern(args.moe_layer_freq, args.num_layers)]


def mtp_block_spec(args: argparse.Namespace, config: TransformerConfig, vp_stage: int | None = None) -> object | None:
    """megatron-core's MTP block on this chunk (None where it holds no MTP layer): each MTP layer is
    the last decoder layer's spec (as Megatron-LM's gpt_builder) with the device provider's norms."""
    if not getattr(args, "mtp_num_layers", None):
        return None
    last_layer = decoder_layer_specs(args)[-1]
    return mtp_block_spec_for_backend(config, last_layer, spec_provider(args), vp_stage)


def _layer_spec(args: argparse.Namespace) -> ModuleSpec:
    backend = spec_provider(args)
    mla = bool(getattr(args, "multi_latent_attention", False))
    spec = get_gpt_layer_local_spec(
        qk_layernorm=args.qk_layernorm, multi_latent_attention=mla, normalization=args.normalization
    )
    layer = spec.submodules
    norm = backend.layer_norm(rms_norm=args.normalization == "RMSNorm")
    layer.input_layernorm = layer.pre_mlp_layernorm = norm
    attention = layer.self_attention.submodules
    attention.core_attention = backend.core_attention()
    if args.qk_layernorm:
        qk_norm = backend.layer_norm(for_qk=True)
        if mla:  # the norms of the query and key/value latents
            attention.q_layernorm = attention.kv_layernorm = qk_norm
        else:
            attention.q_layernorm = attention.k_layernorm = qk_norm
    # Built only when config.use_te_activation_func is set (training/config.py: device SwiGLU).
    mlp_submodules(layer.mlp).activation_func = backend.activation_func()
    return spec
