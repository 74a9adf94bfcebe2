"""The objects a run is built from, once the process groups exist: model chunks (one per
virtual stage, on the device, in megatron-core's DDP), optimizer, LR scheduler, and the hooks
megatron-core's schedules call back into. Each takes the settings sections it reads, nothing else."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from megatron_npu.accelerator import get_accelerator
from megatron_npu.compat import parallel_state, standard_megatron_optimizer  # parallel_state: vp_stage on 0.12
from megatron_npu.layout.parallel_dims import ParallelDims
from megatron_npu.training import fsdp
from megatron_npu.training.config import ddp_config, optimizer_config
from megatron_npu.training.sections import (
    DistributedSection,
    FsdpSection,
    InitSection,
    LoggingSection,
    MixedPrecisionSection,
    OptimizerSection,
    ScheduleSection,
    TrainingSection,
)


def _call_provider(model_provider: Callable, pre: bool, post: bool, vp_stage: int | None) -> torch.nn.Module:
    if "vp_stage" in inspect.signature(model_provider).parameters:
        return model_provider(pre_process=pre, post_process=post, vp_stage=vp_stage)
    return model_provider(pre_process=pre, post_process=post)


def build_model(
    model_provider: Callable,
    parallel: ParallelDims,
    precision: MixedPrecisionSection,
    distributed: DistributedSection,
    training: TrainingSection,
    fsdp_section: FsdpSection,
    init: InitSection,
) -> list[DistributedDataParallel]:
    """One model chunk per virtual stage, on the device, wrapped in megatron-core DDP (or FSDP: fsdp.py)."""
    vpp = parallel.vpp
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        if vp_stage is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(vp_stage)
        ignore_virtual = vp_stage is None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
        chunks.append(_call_provider(model_provider, pre, post, vp_stage))
    if vpp:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    device = get_accelerator().device()
    for chunk in chunks:
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        chunk.to(device)
    if precision.fp16 or precision.bf16:
        chunks = [Float16Module(chunk.config, chunk) for chunk in chunks]
    config = get_model_config(chunks[0])
    ddp = ddp_config(distributed, precision, training, fsdp_section)
    if fsdp_section.enabled:  # as Megatron-LM: FSDP in place of DDP
        wrapped = fsdp.wrap(chunks, config, ddp, fsdp_section, device)
    else:
        wrapped = [
            DistributedDataParallel(config=config, ddp_config=ddp, module=chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)
        ]
    if init.data_parallel_random_init:
        for chunk in wrapped:
            chunk.broadcast_params()
    return wrapped


def build_scheduler(optimizer: Any, schedule: ScheduleSection) -> OptimizerParamScheduler:
    """Megatron-LM's scheduler arithmetic over the validated schedule: steps count samples, not iterations."""
    if schedule.train_iters:
        decay_steps = (schedule.lr_decay_iters or schedule.train_iters) * schedule.global_batch_size
        wd_steps = schedule.train_iters * schedule.global_batch_size
        warmup_steps = schedule.lr_warmup_iters * schedule.global_batch_size
        wsd_steps = schedule.lr_wsd_decay_iters * schedule.global_batch_size if schedule.lr_wsd_decay_iters else None
    else:
        decay_steps = schedule.lr_decay_samples or schedule.train_samples
        wd_steps = schedule.train_samples
        warmup_steps = schedule.lr_warmup_samples
        wsd_steps = schedule.lr_wsd_decay_samples
    if schedule.lr_warmup_fraction is not None:
        warmup_steps = schedule.lr_warmup_fraction * decay_steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=schedule.lr_warmup_init,
        max_lr=schedule.lr,
        min_lr=schedule.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=schedule.lr_decay_style,
        start_wd=schedule.start_weight_decay,
        end_wd=schedule.end_weight_decay,
        wd_incr_steps=wd_steps,
        wd_incr_style=schedule.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=schedule.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=schedule.override_opt_param_scheduler,
        wsd_decay_steps=wsd_steps,
        lr_wsd_decay_style=schedule.lr_wsd_decay_style,
    )


def build_optimizer(
    model: list,
    optim: OptimizerSection,
    schedule: ScheduleSection,
    precision: MixedPrecisionSection,
    distributed: DistributedSection,
    logging: LoggingSection,
) -> Any:
    """megatron-core's optimizer with the standard overrides (the decoupled group marked
    is_decoupled_lr: megatron_npu/patches/optimizer.py)."""
    config = optimizer_config(optim, schedule, precision, distributed, logging)
    return standard_megatron_optimizer(config, model)


def wire_model_config(model: list, optimizer: Any, timers: Any, distributed: DistributedSection) -> Any:
    """The hooks megatron-core's schedules call back into (as Megatron-LM sets them)."""
    config = get_model_config(model[0])
    config.timers = timers
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if distributed.overlap_grad_reduce:
        no_sync = [chunk.no_sync for chunk in model]
        config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
        if distributed.align_grad_reduce:
            grad_sync = [chunk.start_grad_sync for chunk in model]
            config.grad_sync_func = grad_sync[0] if len(model) == 1 else grad_sync
    if distributed.overlap_param_gather and distributed.align_param_gather:
        param_sync = [chunk.start_param_sync for chunk in model]
        config.param_sync_func = param_sync[0] if len(model) == 1 else param_sync
    return config
