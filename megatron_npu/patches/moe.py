"""Mixture of Experts: what megatron-core's MoE layers need off CUDA.

megatron-core 0.16.1's ``moe_utils`` imports Transformer Engine's fused MoE kernels and its
``te_general_gemm`` in a ``try`` block; without TE (torch_npu, CPU torch) the names are never
bound, yet the router's gating GEMM (``RouterGatingLinearFunction``) tests
``te_general_gemm is not None`` unguarded: a NameError on the first MoE forward. Binding it to
None selects megatron-core's own torch path (``torch.mm`` in the router dtype). The other fused
names are reached only under ``--moe-permute-fusion`` / ``--moe-router-fusion``, which
policy.py refuses off CUDA.

And the alltoall dispatcher's split sizes: megatron-core copies them to host numpy arrays in
``maybe_move_tensor_to_cpu`` only when ``tensor.is_cuda``; on the host or an NPU they stayed
tensors, and ``all_to_all_single`` refuses a tensor as split sizes (TypeError on the first
dispatch with EP > 1). gloo has all_to_all_single with uneven splits (measured with
torch 2.13); its all_gather does not take unequal sizes, which the dispatcher's gather over expert
TP uses, so on a target that says so (``lacks_uneven_all_gather``) that gather pads and trims.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "moe"


@register(
    "moe_utils.te_general_gemm",
    "megatron.core.transformer.moe.moe_utils:te_general_gemm",
    reason="the MoE router's gating GEMM reads te_general_gemm, bound only when Transformer Engine imports "
    "(NameError without it); None selects megatron-core's torch.mm path",
    subsystem=SUBSYSTEM,
    create=True,
)
def _te_general_gemm(original: Any, accelerator: Accelerator) -> Any:
    return original if callable(original) else None


@register(
    "moe_utils.maybe_move_tensor_to_cpu.host_tensors",
    "megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu",
    reason="the alltoall dispatcher turns its split sizes into host numpy arrays only for CUDA tensors "
    "(tensor.is_cuda); host and NPU tensors stayed tensors, which all_to_all_single refuses as split sizes",
    subsystem=SUBSYSTEM,
)
def _maybe_move_tensor_to_cpu(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if not torch.is_tensor(tensor) or tensor.is_cuda:
            return original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        # a blocking copy: megatron's side-stream event only orders CUDA copies
        host = tensor if tensor.is_cpu else tensor.cpu()
        return host.numpy() if as_numpy else host

    return maybe_move_tensor_to_cpu


@register(
    "mappings._gather_along_first_dim.uneven",
    "megatron.core.tensor_parallel.mappings:_gather_along_first_dim",
    reason="with expert TP > 1 the alltoall dispatcher gathers a different number of tokens from each rank "
    "(all_gather of unequal tensors); gloo refuses unequal sizes, so each rank's part is padded to the "
    "largest, gathered at one size and trimmed",
    subsystem=SUBSYSTEM,
    requires="lacks_uneven_all_gather",
)
def _gather_uneven(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def _gather_along_first_dim(
        input_: torch.Tensor, group: Any = None, output_split_sizes: Any = None, use_global_buffer: bool = False
    ) -> torch.Tensor:
        # group=None: 0.12's default (the TP group; sequence parallelism's backward passes none), equal sizes
        if output_split_sizes is None or group is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])

    return _gather_along_first_dim
