"""The transformer-layer ModuleSpec of pretrain_gpt.py: where a backend plugs in.

megatron-core's local spec (its own linear layers and MLP; no Transformer Engine) with
the norm and core attention of megatron_npu.ops.spec_provider.DeviceSpecProvider, the
backend seam megatron-core's TE spec uses: a sequence-parallel-capable norm (the device's
fused RMSNorm where there is one), the SwiGLU activation on the device's kernel, and, with
``--use-flash-attn`` on a device with a fused attention kernel, FusedDotProductAttention; with
``--context-parallel-size`` > 1, ContextParallelAttention (ring, all-to-all or both).
Multi-latent attention is megatron-core's MLASelfAttention (its local spec), multi-token
prediction its MTP block (``get_gpt_mtp_block_spec_for_backend``) on this provider.
``gpt_model`` builds pretrain_gpt.py's model chunk from these specs and the model's sections.
"""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import transformer_block
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_npu.compat.core import call_with_vp_stage, mtp_block_spec_for_backend
from megatron_npu.compat.specs import (  # megatron-core's, on every supported release
    get_num_layers_to_build,
    get_transformer_layer_offset,
    mlp_submodules,
    moe_module_spec,
)
from megatron_npu.layout.moe import moe_layer_pattern
from megatron_npu.ops.spec_provider import DeviceSpecProvider
from megatron_npu.training.config import ModelSettings, transformer_config


def gpt_model(
    settings: ModelSettings,
    vocab_size: int,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
) -> GPTModel:
    """One GPT model chunk (the whole model without pipeline parallelism) from the model's sections and
    layout, as pretrain_gpt.py's model_provider builds it; ``vocab_size``: the padded vocabulary."""
    model, config = settings.model, transformer_config(settings)
    return call_with_vp_stage(  # GPTModel takes vp_stage from megatron-core 0.13
        GPTModel,
        config=config,
        transformer_layer_spec=gpt_layer_spec(settings, vp_stage),
        mtp_block_spec=mtp_block_spec(settings, config, vp_stage),
        vocab_size=vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=settings.precision.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
        rotary_percent=model.rotary_percent,
        rotary_base=model.rotary_base,
        rope_scaling=model.use_rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor,
        seq_len_interpolation_factor=model.rotary_seq_len_interpolation_factor,
        vp_stage=vp_stage,
    )


def spec_provider(settings: ModelSettings) -> DeviceSpecProvider:
    return DeviceSpecProvider(
        use_flash_attn=bool(settings.training.use_flash_attn), context_parallel=settings.parallel.cp > 1
    )


def uses_fused_attention(settings: ModelSettings) -> bool:
    return spec_provider(settings).fused_attention()


def gpt_layer_spec(settings: ModelSettings, vp_stage: int | None = None) -> ModuleSpec | TransformerBlockSubmodules:
    """The layer spec; with --num-experts or --pipeline-model-parallel-layout, the block spec of this
    pipeline chunk's layers (dense and MoE layers by --moe-layer-freq, as megatron-core's
    get_gpt_decoder_block_spec slices them)."""
    if settings.moe.num_experts is None and settings.model.pipeline_model_parallel_layout is None:
        return _layer_spec(settings)
    config = transformer_config(settings)
    specs = decoder_layer_specs(settings)
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


def decoder_layer_specs(settings: ModelSettings) -> list[ModuleSpec]:
    """Every decoder layer's spec, in order (megatron-core's get_gpt_decoder_layer_specs)."""
    dense, moe_section, num_layers = _layer_spec(settings), settings.moe, settings.model.num_layers
    if moe_section.num_experts is None:
        return [dense] * num_layers
    moe = _layer_spec(settings)
    moe.submodules.mlp = moe_module_spec(spec_provider(settings), moe_section.num_experts, moe_section.moe_grouped_gemm)
    return [moe if is_moe else dense for is_moe in moe_layer_pattern(moe_section.moe_layer_freq, num_layers)]


def mtp_block_spec(settings: ModelSettings, config: TransformerConfig, vp_stage: int | None = None) -> object | None:
    """megatron-core's MTP block on this chunk (None where it holds no MTP layer): each MTP layer is
    the last decoder layer's spec (as Megatron-LM's gpt_builder) with the device provider's norms."""
    if not settings.model.mtp_num_layers:
        return None
    last_layer = decoder_layer_specs(settings)[-1]
    return mtp_block_spec_for_backend(config, last_layer, spec_provider(settings), vp_stage)


def _layer_spec(settings: ModelSettings) -> ModuleSpec:
    backend, model = spec_provider(settings), settings.model
    mla = bool(model.multi_latent_attention)
    spec = get_gpt_layer_local_spec(
        qk_layernorm=model.qk_layernorm, multi_latent_attention=mla, normalization=model.normalization
    )
    layer = spec.submodules
    norm = backend.layer_norm(rms_norm=model.normalization == "RMSNorm")
    layer.input_layernorm = layer.pre_mlp_layernorm = norm
    attention = layer.self_attention.submodules
    attention.core_attention = backend.core_attention()
    if model.qk_layernorm:
        qk_norm = backend.layer_norm(for_qk=True)
        if mla:  # the norms of the query and key/value latents
            attention.q_layernorm = attention.kv_layernorm = qk_norm
        else:
            attention.q_layernorm = attention.k_layernorm = qk_norm
    # Built only when config.use_te_activation_func is set (training/config.py: device SwiGLU).
    mlp_submodules(layer.mlp).activation_func = backend.activation_func()
    return spec
