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
import sys
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


class _AbsentTELinear:
    """Stands for Transformer Engine's TELinear where TE is not installed: no module is one."""


@register(
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter.TELinear.absent",
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter:TELinear",
    megatron_versions=VERSIONS,
    reason="without Transformer Engine the adapter's TELinear is not a class (megatron-core leaves a MagicMock), "
    "and FullyShardedDataParallel's "
    "_fix_tensor_parallel_attributes calls isinstance(module, (TELinear,)) under TP > 1: TypeError at wrap time; "
    "a class no module is an instance of (TE's own class where TE imports)",
    subsystem=SUBSYSTEM,
)
def _te_linear(original: Any, accelerator: Accelerator) -> Any:
    return original if isinstance(original, type) else _AbsentTELinear


def _empty_shard_state(template: dict[str, Any], param: torch.Tensor) -> dict[str, Any]:
    """Optimizer state for a parameter whose shard on this rank is empty: the template's entries, the
    per-element ones (DTensors shaped like their parameter) as empty shards of this one."""
    from torch.distributed.tensor import DTensor

    return {
        key: torch.zeros_like(param)
        if isinstance(value, DTensor)
        else (value.clone() if torch.is_tensor(value) else value)
        for key, value in template.items()
    }


def same_optimizer_state_on_every_rank(original: Callable) -> Callable:
    """``sharded_param_state_fsdp_dtensor`` whose state names every parameter, in parameter order, on every rank.

    Megatron-FSDP shards each bucket evenly over the DP ranks, so a small parameter (a norm's weight)
    can lie wholly in one rank's shard: the others never step it and hold no optimizer state for it,
    and the state dict's order is the order in which parameters were first stepped. Megatron-FSDP's
    uneven-DTensor preprocessing then runs one collective per DTensor of the state dict in its order:
    with different DTensors on different ranks the save hangs (measured: 2 ranks, gloo). Empty-shard
    entries (zeros of size 0) are added and the state ordered as the optimizer's parameter groups.
    """

    @functools.wraps(original)
    def sharded_param_state_fsdp_dtensor(self: Any, is_loading: bool = False) -> dict[str, Any]:
        result = original(self, is_loading)
        state = self.optimizer.state
        template = next((entry for entry in state.values() if entry), None)
        params = [param for group in self.optimizer.param_groups for param in group["params"]]
        if template is not None:
            for param in params:
                local = getattr(param, "_local_tensor", param)
                if not state.get(param) and local.numel() == 0:
                    state[param] = _empty_shard_state(template, param)
        named = {self._param_name(param): state[param] for param in params if param in state}
        others = {key: value for key, value in result["state"].items() if key not in named}
        result["state"] = named | others
        return result

    return sharded_param_state_fsdp_dtensor


register(
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.sharded_param_state_fsdp_dtensor.every_rank",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_param_state_fsdp_dtensor",
    megatron_versions=VERSIONS,
    reason="a parameter wholly in another rank's Megatron-FSDP shard has no optimizer state here, and the state's "
    "order is the order of first steps: the fsdp_dtensor save runs one collective per DTensor and hangs when ranks "
    "differ; every parameter gets an entry (empty shards), in parameter order",
    subsystem=SUBSYSTEM,
)(lambda original, accelerator: same_optimizer_state_on_every_rank(original))


def nothing_to_gather_under_no_shard(original: Callable) -> Callable:
    """``MegatronFSDP.start_param_sync`` that gathers nothing where no bucket has a sharded weight buffer.

    Under ``--data-parallel-sharding-strategy no_shard`` every rank holds whole weights and no parameter
    group has a model-weight buffer; the synchronous path (``--overlap-param-gather`` off) still calls
    ``async_bucket_gather`` for each bucket before its ``model_weight_buffer is None`` check, which then
    fetches a bucket from ``None`` (AttributeError after the first optimizer step, on every target).
    """

    @functools.wraps(original)
    def start_param_sync(self: Any, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> Any:
        groups = self.param_and_grad_buffer.parameter_groups
        if all(group.model_weight_buffer is None for group in groups):
            self._replace_param_with_raw_if_needed()  # what the original does first, on any path
            return None
        return original(self, *unused, force_sync=force_sync, force_dispatch=force_dispatch)

    return start_param_sync


register(
    "megatron_fsdp.MegatronFSDP.start_param_sync.no_shard",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp:MegatronFSDP.start_param_sync",
    megatron_versions=VERSIONS,
    reason="under no_shard there is no weight buffer to gather, but the synchronous param sync gathers each "
    "bucket before checking for one: AttributeError after the first step without --overlap-param-gather; "
    "nothing is gathered when no bucket has a weight buffer",
    subsystem=SUBSYSTEM,
)(lambda original, accelerator: nothing_to_gather_under_no_shard(original))


def all_reduce_every_gradient_buffer(original: Callable) -> Callable:
    """``ParamAndGradBuffer.all_reduce_gradients`` that reduces the groups that have a gradient buffer.

    megatron-core 0.16.1 skips each group whose ``main_grad_buffer`` is *not* None (an inverted test),
    so under ``no_shard`` without ``--overlap-grad-reduce`` (the synchronous path) no gradient is ever
    reduced: every DP rank steps on its own micro-batches' gradient (silent; measured: 2 ranks leave the
    1-rank losses at the third iteration). The reduction itself is megatron-core's: its preprocessing
    (the 1/DP scaling and the reduce op, patched above where the library lacks PREMUL_SUM), one
    all-reduce per buffer on the buffer's group.
    """
    buffer_module = sys.modules[original.__module__]

    @functools.wraps(original)
    def all_reduce_gradients(self: Any, async_op: bool = False) -> None:
        pending = []
        for group in self.parameter_groups:
            buffer = group.main_grad_buffer
            if buffer is None:
                continue
            reduce_op = buffer_module.gradient_reduce_preprocessing(
                buffer.data, buffer.gradient_scaling_factor, self.ddp_config
            )
            handle = torch.distributed.all_reduce(
                buffer.data, op=reduce_op, group=buffer.data_parallel_group, async_op=async_op
            )
            pending += [handle] if async_op else []
        for handle in pending:
            handle.wait()

    return all_reduce_gradients


register(
    "megatron_fsdp.ParamAndGradBuffer.all_reduce_gradients.inverted_skip",
    f"{MEGATRON_FSDP_BUFFER}:ParamAndGradBuffer.all_reduce_gradients",
    megatron_versions=VERSIONS,
    reason="skips every parameter group that has a gradient buffer (`if gbuf is not None: continue`): under "
    "no_shard without --overlap-grad-reduce no gradient is reduced over DP (silent); each buffer is reduced",
    subsystem=SUBSYSTEM,
)(lambda original, accelerator: all_reduce_every_gradient_buffer(original))


def _storage_key(tensor: torch.Tensor) -> tuple:
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)


def match_dtensor_params_by_storage(original: Callable) -> Callable:
    """``get_param_id_to_sharded_param_map`` that also finds DTensor parameters (torch FSDP2's).

    megatron-core matches an optimizer parameter with the model's sharded tensor by the Python identity of
    the local tensor each side took with ``DTensor.to_local()``; from torch 2.x that call returns a new view
    object each time (measured on torch 2.13 under no_grad), so no FSDP2 parameter matches and the save
    raises "Param id 0 does not match any model sharded param". Parameters left unmatched are matched by
    the storage, offset and shape of their local shard: the same memory, whichever view names it.
    """
    module = sys.modules[original.__module__]

    @functools.wraps(original)
    def get_param_id_to_sharded_param_map(model_sharded_state_dict: Any, optim_params_iter: Any) -> dict:
        params = list(optim_params_iter)
        found = original(model_sharded_state_dict, params)
        if len(found) == len(params):
            return found
        tensors, _ = module.extract_sharded_tensors_and_factories(model_sharded_state_dict)
        by_storage = {_storage_key(ten.data): ten for ten in module.nested_values(tensors) if torch.is_tensor(ten.data)}
        for index, param in enumerate(params):
            local = getattr(param, "_local_tensor", None)
            if index not in found and local is not None and _storage_key(local) in by_storage:
                found[index] = by_storage[_storage_key(local)]
        return found

    return get_param_id_to_sharded_param_map


register(
    "dist_checkpointing.optimizer.get_param_id_to_sharded_param_map.dtensor_storage",
    "megatron.core.dist_checkpointing.optimizer:get_param_id_to_sharded_param_map",
    megatron_versions=VERSIONS,
    reason="matches optimizer parameters with the model's sharded tensors by the identity of DTensor.to_local() "
    "views, a new object per call on current torch: torch FSDP2's checkpoints fail ('Param id 0 does not match "
    "any model sharded param'); unmatched DTensor parameters are matched by their local shard's storage",
    subsystem=SUBSYSTEM,
)(lambda original, accelerator: match_dtensor_params_by_storage(original))


class ParametersByName:
    """The model as megatron-core's ``handle_swiglu_in_state_dict`` reads it: its ``config`` and its parameters by
    name, the wrappers' ``module.`` prefixes or not. That function looks model-state keys up as ``module.{key}`` and
    optimizer-state keys with their ``module.`` cut off, on the one model it is given: no model answers both (a
    wrapped one lacks the bare names, an unwrapped one the prefixed), so every SwiGLU save under Megatron-FSDP
    raised: Megatron-LM passes the unwrapped GPTModel ("GPTModel has no attribute `module`"), this trainer the
    wrapper ("MegatronFSDP has no attribute `decoder`")."""

    def __init__(self, model: torch.nn.Module) -> None:
        inner = model
        while isinstance(getattr(inner, "module", None), torch.nn.Module):  # FullyShardedDataParallel, MegatronFSDP
            inner = inner.module
        self.module = inner
        if hasattr(inner, "config"):
            self.config = inner.config

    def get_parameter(self, name: str) -> torch.nn.Parameter:
        while name.startswith("module."):
            name = name[len("module.") :]
        return self.module.get_parameter(name)


@register(
    "megatron.core.transformer.fsdp_dtensor_checkpoint.handle_swiglu_in_state_dict.parameter_names",
    "megatron.core.transformer.fsdp_dtensor_checkpoint:handle_swiglu_in_state_dict",
    # the two lookups (model keys as module.{key}, optimizer keys with module. cut off) in 0.14.0 ... 0.19.2
    megatron_versions=">=0.14.0,<0.20",
    reason="looks parameters up as module.{key} for the model state and with module. cut off for the optimizer "
    "state, on one model: every --swiglu fsdp_dtensor save raises (Megatron-LM passes the unwrapped GPTModel: "
    "'GPTModel has no attribute module'; a known megatron-core defect, NVIDIA/Megatron-LM issue #5265, "
    "NVIDIA-NeMo/Megatron-Bridge #4236); the model it gets answers both names",
    subsystem=SUBSYSTEM,
)
def _handle_swiglu_in_state_dict(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def handle_swiglu_in_state_dict(model: torch.nn.Module, model_state_dict: Any, optimizer_state_dict: Any) -> Any:
        return original(ParametersByName(model), model_state_dict, optimizer_state_dict)

    return handle_swiglu_in_state_dict
