"""megatron-core's typed configs built from Megatron-LM arguments.

One function per config; the argument namespace is read here and nowhere else in
megatron-core's terms, so a new flag lands in exactly one place.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from megatron.core.activations import squared_relu
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.utils import openai_gelu

from megatron_npu.accelerator import get_accelerator

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Fusions implemented as CUDA extensions: used only where the extension imports.
# The TorchScript fusions (bias-gelu, bias-swiglu, bias-dropout-add) are used where
# the accelerator says the jit fuser serves it; elsewhere the same math runs unfused.
CUDA_EXTENSION_FUSIONS = {
    "masked_softmax_fusion": "scaled_masked_softmax_cuda",
    "gradient_accumulation_fusion": "fused_weight_gradient_mlp_cuda",
}


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    """``args.params_dtype`` ("float32" / "float16" / "bfloat16", derived in validation.py) as a torch dtype."""
    return DTYPES[args.params_dtype]


def available_fusions(args: argparse.Namespace) -> dict[str, bool]:
    """The CUDA-extension fusions the arguments ask for, and whether they can run here."""
    return {
        name: bool(getattr(args, name, False)) and importlib.util.find_spec(module) is not None
        for name, module in CUDA_EXTENSION_FUSIONS.items()
    }


def rope_fusion(args: argparse.Namespace) -> bool:
    """--no-rope-fusion runs megatron's unfused RoPE math on every target; otherwise the fused
    kernel runs where one exists: Transformer Engine's, or the device's (patches/fused_ops.py)."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return bool(args.apply_rope_fusion)
    # The device kernel is half-split only (and megatron's config check asks TE for interleaved).
    return bool(args.apply_rope_fusion) and get_accelerator().has_fused_rotary and not args.rotary_interleaved


def device_swiglu_fusion(args: argparse.Namespace) -> bool:
    """SwiGLU on the device's kernel: --swiglu, fusion not turned off, a kernel on this device."""
    return bool(args.swiglu and args.bias_swiglu_fusion) and get_accelerator().fused_kernel("swiglu") is not None


def _activation(args: argparse.Namespace) -> tuple[Callable, bool]:
    """(activation_func, gated_linear_unit) as Megatron-LM derives them."""
    if args.swiglu:
        return F.silu, True
    if args.squared_relu:
        return squared_relu, False
    if args.openai_gelu:
        return openai_gelu, False
    return F.gelu, False


def _optional(args: argparse.Namespace) -> dict:
    """Fields set only when given: megatron-core's own defaults stand otherwise."""
    extra: dict = {}
    if args.recompute_modules is not None:
        extra["recompute_modules"] = args.recompute_modules
    if args.init_method_xavier_uniform:  # as Megatron-LM: both init methods
        extra["init_method"] = extra["output_layer_init_method"] = torch.nn.init.xavier_uniform_
    return extra


# Megatron-LM copies every TransformerConfig field of the same name from args; these are the MoE ones.
MOE_FIELDS = (
    "moe_layer_freq",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_input_jitter_eps",
    "moe_router_topk",
    "moe_router_pre_softmax",
    "moe_router_score_function",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_dtype",
    "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate",
    "moe_grouped_gemm",
    "moe_token_dispatcher_type",
    "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity",
    "moe_token_drop_policy",
    "moe_per_layer_logging",
)


def _moe(args: argparse.Namespace) -> dict:
    """MoE fields (Megatron-LM's names; ``--num-experts`` is ``num_moe_experts``); none for a dense model."""
    extra: dict = {
        "expert_model_parallel_size": args.expert_model_parallel_size,
        "expert_tensor_parallel_size": args.expert_tensor_parallel_size,
    }
    if args.num_experts is None:
        return extra
    extra["num_moe_experts"] = args.num_experts
    extra.update({name: getattr(args, name) for name in MOE_FIELDS})
    return extra


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    activation, gated = _activation(args)
    fusions = available_fusions(args)
    # The flags as given; where the TorchScript fuser does not serve the device the patch on
    # TransformerConfig.__post_init__ (patches/transformer.py) turns the jit fusions off.
    device_swiglu = device_swiglu_fusion(args)
    if args.swiglu:  # megatron's fused SwiGLU: the device kernel (the spec's activation module), or TorchScript
        bias_activation_fusion = args.bias_swiglu_fusion and not device_swiglu
    else:  # bias-GeLU fuses only a bias that exists
        bias_activation_fusion = args.bias_gelu_fusion and args.add_bias_linear
    dtype = params_dtype(args)
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.norm_epsilon,
        normalization=args.normalization,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias or args.add_bias_linear,
        gated_linear_unit=gated,
        activation_func=activation,
        bias_activation_fusion=bool(bias_activation_fusion),
        use_te_activation_func=device_swiglu,  # megatron's seam for a spec'd activation module
        bias_dropout_fusion=args.bias_dropout_fusion,
        masked_softmax_fusion=fusions["masked_softmax_fusion"],
        gradient_accumulation_fusion=fusions["gradient_accumulation_fusion"],
        apply_rope_fusion=rope_fusion(args),
        init_method_std=args.init_method_std,
        embedding_init_method_std=args.embedding_init_method_std,
        apply_residual_connection_post_layernorm=args.apply_residual_connection_post_layernorm,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        qk_layernorm=args.qk_layernorm,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        overlap_p2p_comm=args.overlap_p2p_comm,
        batch_p2p_comm=args.batch_p2p_comm,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        fp16=args.fp16,
        bf16=args.bf16,
        fp32_residual_connection=getattr(args, "fp32_residual_connection", False),
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        use_cpu_initialization=bool(args.use_cpu_initialization),
        perform_initialization=args.perform_initialization,
        rotary_interleaved=args.rotary_interleaved,
        distribute_saved_activations=args.distribute_saved_activations,
        clone_scatter_output_in_embedding=args.clone_scatter_output_in_embedding,
        deterministic_mode=args.deterministic_mode,
        calculate_per_token_loss=args.calculate_per_token_loss,
        overlap_p2p_comm_warmup_flush=args.overlap_p2p_comm_warmup_flush,
        defer_embedding_wgrad_compute=args.defer_embedding_wgrad_compute,
        wgrad_deferral_limit=args.wgrad_deferral_limit,
        **_optional(args),
        **_moe(args),
        deallocate_pipeline_outputs=True,  # as Megatron-LM; patches/pipeline_parallel.py keeps it off on gloo
        barrier_with_L1_time=False,
    )


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        # megatron-core gives the embedding and output-layer parameters their own group on this schedule
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=params_dtype(args),
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather_with_optimizer_step=False,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        barrier_with_L1_time=False,
    )


def ddp_config(args: argparse.Namespace) -> DistributedDataParallelConfig:
    # bf16 reduces gradients in fp32 unless --grad-reduce-in-bf16 (validation.py derives it).
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        average_in_collective=args.ddp_average_in_collective,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        bucket_size=args.ddp_bucket_size,
    )
