"""megatron-core's typed configs built from Megatron-LM arguments.

One function per config. The TransformerConfig is built as Megatron-LM builds it: every field
with a flag of the same name by reflection, the exceptions listed once (``_derived_fields``), so a
new megatron-core field with a Megatron-LM flag needs no code here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F  # noqa: N812
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.transformer.utils import openai_gelu

from megatron_npu.accelerator import get_accelerator
from megatron_npu.compat import release_config, squared_relu
from megatron_npu.compat.core import quick_gelu
from megatron_npu.ops.fused import fused_rotary_serves
from megatron_npu.training.sections import (
    CheckpointSection,
    DistributedSection,
    FsdpSection,
    LoggingSection,
    MixedPrecisionSection,
    ModelSection,
    MoeSection,
    OptimizerSection,
    ScheduleSection,
    TrainingSection,
)

if TYPE_CHECKING:
    from megatron_npu.layout.parallel_dims import ParallelDims

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Fusions implemented as CUDA extensions: used only where the extension imports.
# The TorchScript fusions (bias-gelu, bias-swiglu, bias-dropout-add) are used where
# the accelerator says the jit fuser serves it; elsewhere the same math runs unfused.
CUDA_EXTENSION_FUSIONS = {
    "masked_softmax_fusion": "scaled_masked_softmax_cuda",
    "gradient_accumulation_fusion": "fused_weight_gradient_mlp_cuda",
}


class ModelSettings(Protocol):
    """The sections a model is built from, and its layout: ``Settings`` has them (the trainer), and
    ``megatron_npu.convert`` builds its own from a Hugging Face config, without the trainer's flags."""

    model: ModelSection
    moe: MoeSection
    precision: MixedPrecisionSection
    training: TrainingSection  # fusions, recomputation, sequence parallelism
    distributed: DistributedSection  # p2p and context-parallel communication
    checkpoint: CheckpointSection  # perform_initialization (--no-initialization)
    parallel: ParallelDims


def params_dtype(precision: MixedPrecisionSection) -> torch.dtype:
    """``params_dtype`` ("float32" / "float16" / "bfloat16", derived in validation.py) as a torch dtype."""
    return DTYPES[precision.params_dtype]


def available_fusions(training: TrainingSection) -> dict[str, bool]:
    """The CUDA-extension fusions the settings ask for, and whether they can run here."""
    return {
        name: bool(getattr(training, name)) and importlib.util.find_spec(module) is not None
        for name, module in CUDA_EXTENSION_FUSIONS.items()
    }


def rope_fusion(settings: ModelSettings) -> bool:
    """--no-rope-fusion runs megatron's unfused RoPE math on every target; otherwise the fused
    kernel runs where one exists: Transformer Engine's, or the device's (megatron_npu/patches/fused_ops.py)."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return bool(settings.training.apply_rope_fusion)
    # (megatron's config check also asks TE for an interleaved fused RoPE)
    return bool(settings.training.apply_rope_fusion) and fused_rotary_serves(settings.model.rotary_interleaved)


def device_swiglu_fusion(model: ModelSection, training: TrainingSection) -> bool:
    """SwiGLU on the device's kernel: --swiglu, fusion not turned off, a kernel on this device."""
    return bool(model.swiglu and training.bias_swiglu_fusion) and get_accelerator().fused_kernel("swiglu") is not None


def _activation(model: ModelSection) -> tuple[Callable, bool]:
    """(activation_func, gated_linear_unit) as Megatron-LM derives them."""
    if model.swiglu:
        return F.silu, True
    if model.quick_geglu:  # gpt-oss: gated quick-GeLU (offset and clamp: config fields)
        return quick_gelu(), True
    if model.squared_relu:
        return squared_relu, False
    if model.openai_gelu:
        return openai_gelu, False
    return F.gelu, False


def _bias_activation_fusion(model: ModelSection, training: TrainingSection) -> bool:
    """megatron's fused bias-activation: for SwiGLU the device kernel (the spec's activation module)
    or TorchScript; bias-GeLU fuses only a bias that exists. Where the TorchScript fuser does not
    serve the device the patch on TransformerConfig.__post_init__ (megatron_npu/patches/transformer.py) turns
    the jit fusions off."""
    if model.swiglu:
        return bool(training.bias_swiglu_fusion and not device_swiglu_fusion(model, training))
    if model.quick_geglu:
        # megatron-core fuses quick-GeGLU only with per-token scales (its MLP raises otherwise): the same
        # math runs unfused
        return False
    return bool(training.bias_gelu_fusion and model.add_bias_linear)


def _derived_fields(settings: ModelSettings) -> dict[str, Any]:
    """The TransformerConfig fields whose value is not the flag of the same name: Megatron-LM's other
    spellings and what this trainer derives (the one list of exceptions to the reflection)."""
    model, training = settings.model, settings.training
    activation, gated = _activation(model)
    fusions = available_fusions(training)
    dtype = params_dtype(settings.precision)
    fields: dict[str, Any] = {
        "layernorm_epsilon": model.norm_epsilon,
        "layernorm_zero_centered_gamma": model.apply_layernorm_1p,
        "add_qkv_bias": model.add_qkv_bias or model.add_bias_linear,
        "gated_linear_unit": gated,
        "activation_func": activation,
        "bias_activation_fusion": _bias_activation_fusion(model, training),
        # megatron's seam for a spec'd activation module
        "use_te_activation_func": device_swiglu_fusion(model, training),
        "masked_softmax_fusion": fusions["masked_softmax_fusion"],
        "gradient_accumulation_fusion": fusions["gradient_accumulation_fusion"],
        "apply_rope_fusion": rope_fusion(settings),
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "use_cpu_initialization": bool(training.use_cpu_initialization),
        "num_moe_experts": settings.moe.num_experts,
        "attention_backend": AttnBackend[str(model.attention_backend).split(".")[-1]],  # the flag's name, an enum
        "deallocate_pipeline_outputs": True,  # as Megatron-LM; megatron_npu/patches/pipeline_parallel.py keeps it off on gloo
        "barrier_with_L1_time": False,
        # as Megatron-LM: one --cp-comm-type for every layer is a string, several are one per layer
        "cp_comm_type": _cp_comm_type(settings.distributed.cp_comm_type),
        # Megatron-LM's spellings of the uneven first / last pipeline stages
        "num_layers_in_first_pipeline_stage": model.decoder_first_pipeline_num_layers,
        "num_layers_in_last_pipeline_stage": model.decoder_last_pipeline_num_layers,
    }
    if model.init_method_xavier_uniform:  # as Megatron-LM: both init methods
        fields["init_method"] = fields["output_layer_init_method"] = torch.nn.init.xavier_uniform_
    return fields


def _cp_comm_type(cp_comm_type: tuple[str, ...]) -> str | list[str]:
    return cp_comm_type[0] if len(cp_comm_type) == 1 else list(cp_comm_type)


def _flag_values(settings: ModelSettings) -> dict[str, Any]:
    """The flags a model reads, by name: its sections' fields and the layout's degrees (Megatron-LM's
    ``args`` holds them all in one namespace; here each comes from the section that owns it)."""
    values: dict[str, Any] = {}
    for section in (settings.model, settings.moe, settings.precision, settings.training, settings.distributed):
        values.update((f.name, getattr(section, f.name)) for f in dataclasses.fields(section))
    dims = settings.parallel
    return values | {
        "tensor_model_parallel_size": dims.tp,
        "pipeline_model_parallel_size": dims.pp,
        "virtual_pipeline_model_parallel_size": dims.vpp,
        "context_parallel_size": dims.cp,
        "expert_model_parallel_size": dims.ep,
        "expert_tensor_parallel_size": dims.expert_tp,
        "perform_initialization": settings.checkpoint.perform_initialization,
        # as validation.py derives them: fixed-length samples; batched p2p unless the interleaved schedule overlaps it
        "variable_seq_lengths": False,
        "batch_p2p_comm": not settings.distributed.overlap_p2p_comm,
    }


def _config_value(field: dataclasses.Field, value: Any) -> Any:
    """A section's tuple as the list megatron-core's field takes (sections hold no lists); a Tuple field keeps it."""
    return list(value) if isinstance(value, tuple) and "tuple" not in str(field.type).lower() else value


# Flags that share a TransformerConfig field's name but must not set it: None means "megatron-core's
# default" for these (Megatron-LM's parser has no default where the dataclass has one).
_DEFAULT_WHEN_NONE = ("recompute_modules",)


def transformer_config(settings: ModelSettings) -> TransformerConfig:
    """As Megatron-LM's core_transformer_config_from_args: every field of the config class
    (MLATransformerConfig with --multi-latent-attention) that has a flag of the same name takes its
    value, then the derived fields above. The YaRN fields without a Megatron-LM flag
    (original_max_position_embeddings, beta_fast, beta_slow) keep MLATransformerConfig's defaults."""
    values = _flag_values(settings)
    config_class = MLATransformerConfig if values.get("multi_latent_attention") else TransformerConfig
    kwargs = {
        f.name: _config_value(f, values[f.name])
        for f in dataclasses.fields(config_class)
        if f.init and f.name in values and not (f.name in _DEFAULT_WHEN_NONE and values[f.name] is None)
    }
    if kwargs.get("rope_type", "") is None:
        del kwargs["rope_type"]  # as Megatron-LM: the class's default (MLA yarn, other attention rope)
    kwargs.update(_derived_fields(settings))
    config = release_config(config_class, kwargs)  # less the fields an older megatron-core lacks
    _set_yarn_attributes(config, values)
    return config


# megatron-core's GPTModel reads standard attention's YaRN from config attributes no TransformerConfig field
# declares (config.yarn_*); their flags, with YarnRotaryEmbedding's defaults where a flag is not given
YARN_ATTRIBUTES = {
    "yarn_rotary_scaling_factor": ("rotary_scaling_factor", 1.0),
    "yarn_original_max_position_embeddings": ("yarn_original_max_position_embeddings", 4096),
    "yarn_beta_fast": ("yarn_beta_fast", 32.0),
    "yarn_beta_slow": ("yarn_beta_slow", 1.0),
    "yarn_mscale": ("mscale", 1.0),
    "yarn_mscale_all_dim": ("mscale_all_dim", 0.0),
    "yarn_correction_range_round_to_int": ("yarn_correction_range_round_to_int", True),
}


def _set_yarn_attributes(config: TransformerConfig, values: dict[str, Any]) -> None:
    """--position-embedding-type yarn (standard attention): the config.yarn_* attributes GPTModel and the
    attention's mscale read, as Megatron-LM core_v0.19.0's core_transformer_config_from_args sets them."""
    if values.get("position_embedding_type") != "yarn" or values.get("multi_latent_attention"):
        return
    for attribute, (flag, default) in YARN_ATTRIBUTES.items():
        value = values.get(flag)
        setattr(config, attribute, default if value is None else value)


def optimizer_config(
    optim: OptimizerSection,
    schedule: ScheduleSection,
    precision: MixedPrecisionSection,
    distributed: DistributedSection,
    logging: LoggingSection,
) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=optim.optimizer,
        lr=schedule.lr,
        min_lr=schedule.min_lr,
        # megatron-core gives the embedding and output-layer parameters their own group on this schedule
        decoupled_lr=schedule.decoupled_lr,
        decoupled_min_lr=schedule.decoupled_min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        sgd_momentum=optim.sgd_momentum,
        clip_grad=optim.clip_grad,
        fp16=precision.fp16,
        bf16=precision.bf16,
        params_dtype=params_dtype(precision),
        loss_scale=optim.loss_scale,
        initial_loss_scale=optim.initial_loss_scale,
        min_loss_scale=optim.min_loss_scale,
        loss_scale_window=optim.loss_scale_window,
        hysteresis=optim.hysteresis,
        use_distributed_optimizer=distributed.use_distributed_optimizer,
        overlap_param_gather_with_optimizer_step=False,
        log_num_zeros_in_grad=logging.log_num_zeros_in_grad,
        barrier_with_L1_time=False,
    )


def ddp_config(
    distributed: DistributedSection, precision: MixedPrecisionSection, training: TrainingSection, fsdp: FsdpSection
) -> DistributedDataParallelConfig:
    # bf16 reduces gradients in fp32 unless --grad-reduce-in-bf16 (validation.py derives it).
    return release_config(  # less the fields an older megatron-core lacks
        DistributedDataParallelConfig,
        dict(
            grad_reduce_in_fp32=precision.accumulate_allreduce_grads_in_fp32,
            average_in_collective=distributed.ddp_average_in_collective,
            overlap_grad_reduce=distributed.overlap_grad_reduce,
            overlap_param_gather=distributed.overlap_param_gather,
            use_distributed_optimizer=distributed.use_distributed_optimizer,
            check_for_nan_in_grad=training.check_for_nan_in_loss_and_grad,
            bucket_size=distributed.ddp_bucket_size,
            # Megatron-FSDP (training/fsdp.py); megatron-core's DDP reads none of these
            use_megatron_fsdp=fsdp.use_megatron_fsdp,
            use_custom_fsdp=fsdp.use_megatron_fsdp,
            data_parallel_sharding_strategy=fsdp.data_parallel_sharding_strategy,
            gradient_reduce_div_fusion=fsdp.gradient_reduce_div_fusion,
            suggested_communication_unit_size=fsdp.suggested_communication_unit_size,
        ),
    )
