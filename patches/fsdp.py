"""FSDP: megatron-core's Megatron-FSDP and its torch FSDP2 wrapper off CUDA.

Both build a ``DeviceMesh`` for the CUDA device type by name
(``DeviceMesh.from_group(group, "cuda")`` in torch_fully_sharded_data_parallel.py,
``device_type="cuda"`` in fsdp/mcore_fsdp_adapter.py and megatron_fsdp/fully_shard.py):
the mesh's device type decides where FSDP2 puts its shards and which process-group
backend DTensor's collectives look for, so it becomes the accelerator's.

Megatron-FSDP reduces gradients with torch's ``PREMUL_SUM`` op (the 1/DP scaling fused
into the reduce-scatter or all-reduce) unless told otherwise. Where the collective library
has no such op (gloo), the same scaling runs before a plain SUM, as megatron-core itself
does for bf16 gradients: the same arithmetic, one multiply per element, then the sum.
Reduce-scatter and all-gather into flat tensors, coalesced, run on gloo as they are
(torch 2.13, measured) and need no patch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

from .device_arguments import FOREIGN_DEVICE_TYPE

SUBSYSTEM = "fsdp"
#: megatron-core releases these patches were verified with (Megatron-FSDP's internals move between releases)
VERSIONS = ">=0.16.0,<0.17"
MEGATRON_FSDP_BUFFER = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"


@register(
    "torch.distributed.device_mesh.DeviceMesh.__init__.device_type",
    "torch.distributed.device_mesh:DeviceMesh.__init__",
    reason="megatron-core's FSDP builds its meshes for device type 'cuda' by name (DeviceMesh.from_group(pg, "
    "'cuda'), device_type='cuda'): the mesh's device type becomes the accelerator's",
    subsystem=SUBSYSTEM,
)
def _device_mesh_init(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def __init__(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        if device_type == FOREIGN_DEVICE_TYPE:
            device_type = accelerator.device_type
        original(self, device_type, *args, **kwargs)

    return __init__


def scaled_sum_preprocessing(original: Callable) -> Callable:
    """``gradient_reduce_preprocessing`` that never returns a PREMUL_SUM op: it scales the
    gradients in place and reduces them with SUM (the path megatron-core takes for bf16)."""

    @functools.wraps(original)
    @torch.no_grad()
    def gradient_reduce_preprocessing(grad_data: torch.Tensor, scaling_factor: Any, ddp_config: Any) -> Any:
        if scaling_factor is None or ddp_config.average_in_collective or not ddp_config.gradient_reduce_div_fusion:
            return original(grad_data, scaling_factor, ddp_config)
        grad_data.mul_(scaling_factor)
        return torch.distributed.ReduceOp.SUM

    return gradient_reduce_preprocessing


register(
    "megatron_fsdp.gradient_reduce_preprocessing.premul_sum",
    f"{MEGATRON_FSDP_BUFFER}:gradient_reduce_preprocessing",
    megatron_versions=VERSIONS,
    reason="Megatron-FSDP reduces gradients with PREMUL_SUM (the 1/DP scaling fused into the collective), which "
    "the collective library lacks: the gradients are scaled first and summed",
    subsystem=SUBSYSTEM,
    requires="lacks_premul_sum",
)(lambda original, accelerator: scaled_sum_preprocessing(original))


def single_rank_reduction_in_place(original: Callable) -> Callable:
    """``_bucket_group_gradient_reduce`` that reduces an unsharded bucket in place.

    With one rank in the FSDP group a sharded strategy's gradient buffer is not distributed, so the
    bucket it reduces *is* the gradient buffer: the reduce-scatter's output (a copy of the gradients)
    is then added to the gradients already there, doubling the accumulated gradient at every
    micro-batch (silent: the loss still falls). One rank's reduction is the identity; the no_shard
    path (an in-place all-reduce) computes it without the addition.
    """

    @functools.wraps(original)
    def _bucket_group_gradient_reduce(
        self: Any, bucket_group: list[int], async_op: bool = False, outer_fsdp_group_grad_reduce: bool = False
    ) -> bool:
        config = self.buffer.ddp_config
        alone = (
            config.data_parallel_sharding_strategy != "no_shard"
            and not outer_fsdp_group_grad_reduce
            and all(self.get_fsdp_buffer(bucket).data_parallel_group.size() == 1 for bucket in bucket_group)
        )
        if not alone:
            return original(self, bucket_group, async_op, outer_fsdp_group_grad_reduce)
        strategy = config.data_parallel_sharding_strategy
        config.data_parallel_sharding_strategy = "no_shard"  # read once, to pick the collective
        try:
            return original(self, bucket_group, async_op, outer_fsdp_group_grad_reduce)
        finally:
            config.data_parallel_sharding_strategy = strategy

    return _bucket_group_gradient_reduce


register(
    "megatron_fsdp.GradReducePipeline._bucket_group_gradient_reduce.single_rank",
    f"{MEGATRON_FSDP_BUFFER}:GradReducePipeline._bucket_group_gradient_reduce",
    megatron_versions=VERSIONS,
    reason="with one rank in the FSDP group the gradient bucket is the gradient buffer, and the reduce-scatter's "
    "output is added to it again: every micro-batch doubles the accumulated gradient (silent); reduced in place",
    subsystem=SUBSYSTEM,
)(lambda original, accelerator: single_rank_reduction_in_place(original))


@register(
    "megatron.core.parallel_state.get_nccl_options.foreign",
    "megatron.core.parallel_state:get_nccl_options",
    megatron_versions=VERSIONS,
    reason="builds torch.distributed.ProcessGroupNCCL.Options for groups named in the NCCL communicator configs "
    "(Megatron-LM names 'dp_cp' a high-priority stream under FSDP); off NCCL that class does not exist and "
    "new_group drops NCCL options anyway: none",
    subsystem=SUBSYSTEM,
)
def _get_nccl_options(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def get_nccl_options(pg_name: str, nccl_comm_cfgs: dict) -> None:
        return None

    return get_nccl_options


@register(
    "megatron.core.distributed.data_parallel_base._BaseDataParallel.finish_grad_sync.force_all_reduce",
    "megatron.core.distributed.data_parallel_base:_BaseDataParallel.finish_grad_sync",
    megatron_versions=VERSIONS,
    reason="finalize_model_grads calls finish_grad_sync(force_all_reduce=...), which the base class (and so torch "
    "FSDP2's TorchFullyShardedDataParallel, whose gradients fully_shard reduces in backward) does not take: "
    "TypeError at the first step; the argument is accepted and ignored there",
    subsystem=SUBSYSTEM,
)
def _base_finish_grad_sync(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def finish_grad_sync(self: Any, force_all_reduce: bool | None = False) -> Any:
        return original(self)

    return finish_grad_sync
