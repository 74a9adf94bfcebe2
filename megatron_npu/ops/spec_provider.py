"""megatron-core's backend seam (``BackendSpecProvider``) for the accelerator's kernels.

As ``TESpecProvider`` hands Transformer Engine's modules to the spec builders, this
provider hands out modules that call ``get_accelerator().fused_kernel(key)`` behind a
neutral signature and run the torch math where the device has no kernel: the norm
(fused RMSNorm, sequence-parallel capable), core attention (the fused flash attention
when asked for with ``--use-flash-attn``; with context parallelism ops/context_parallel.py's
ring / all-to-all attention) and the SwiGLU activation (megatron-core builds
a spec'd activation when ``config.use_te_activation_func`` is set; training/config.py
sets it where the device has the kernel and ``--no-bias-swiglu-fusion`` is not given).
Linear layers stay megatron-core's own, and so do an MoE layer's experts (SequentialMLP; its
grouped-GEMM forward with ``--moe-grouped-gemm``).

RoPE has no module here: megatron-core applies it inside SelfAttention, before core
attention; its fused slot is filled by megatron_npu/patches/fused_ops.py and used only when
``config.apply_rope_fusion`` is set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_npu.accelerator import get_accelerator
from megatron_npu.compat.specs import LocalSpecProvider  # megatron.core.models.backends' (0.13+)
from megatron_npu.ops.fused import SwiGLU
from megatron_npu.ops.grouped_gemm import GroupedSequentialMLP
from megatron_npu.ops.norm import SequenceParallelTorchNorm


class DeviceSpecProvider(LocalSpecProvider):
    """megatron-core's local modules, with the accelerator's norm and attention kernels."""

    def __init__(self, use_flash_attn: bool = False, context_parallel: bool = False) -> None:
        self.use_flash_attn = use_flash_attn
        self.context_parallel = context_parallel

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        # LayerNorm or RMSNorm by config.normalization; RMSNorm on the device kernel where there is one.
        return SequenceParallelTorchNorm

    def fused_attention(self) -> bool:
        """True when core attention runs on the device's flash-attention kernel."""
        return self.use_flash_attn and get_accelerator().fused_kernel("flash_attention") is not None

    def core_attention(self) -> type:
        if self.context_parallel:
            # CP > 1: megatron-core's local attention refuses it; ring / Ulysses on the device's blocks
            from megatron_npu.ops.context_parallel import ContextParallelAttention

            return ContextParallelAttention
        if self.fused_attention():
            from megatron_npu.ops.attention import FusedDotProductAttention

            return FusedDotProductAttention
        return DotProductAttention

    def activation_func(self) -> type:
        return DeviceActivation

    def grouped_mlp_modules(
        self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool
    ) -> tuple[type, MLPSubmodules]:
        """The experts of an MoE layer: SequentialMLP, one megatron-core MLP per local expert; with
        ``--moe-grouped-gemm`` its grouped-GEMM forward (ops/grouped_gemm.py: the device's grouped
        matmul). megatron-core's grouped modules need the grouped_gemm CUDA package (GroupedMLP) or
        Transformer Engine (TEGroupedMLP); the grouped forward keeps SequentialMLP's parameters and
        checkpoint keys, the ones megatron-core reshards across EP sizes."""
        experts = GroupedSequentialMLP if moe_use_grouped_gemm else SequentialMLP
        return experts, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


class DeviceActivation:
    """Builds the MLP's activation module from a TransformerConfig (as TEActivationOp does)."""

    def __new__(cls, config: TransformerConfig) -> torch.nn.Module:
        if not (config.gated_linear_unit and config.activation_func is F.silu):
            raise ValueError("the device activation module is SwiGLU only; unset use_te_activation_func")
        return SwiGLU()
