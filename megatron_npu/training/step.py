"""One training step and one forward-only pass over megatron-core's pipeline schedule."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_npu.layout.parallel_dims import ParallelDims
from megatron_npu.training.faults import check_forward_step, non_finite_grad
from megatron_npu.training.run_state import RunState
from megatron_npu.training.sections import DataSection, ScheduleSection


@dataclasses.dataclass
class StepResult:
    """What one optimizer step reports: losses over the global batch (last stage; empty
    elsewhere), whether the optimizer updated, its grad norm and zero count."""

    losses: dict[str, torch.Tensor]
    updated: bool
    grad_norm: float | None
    num_zeros: int | None
    num_microbatches: int


def mean_over_microbatches(reports: list[dict]) -> dict[str, torch.Tensor]:
    """Each reported value over the global batch (last stage only), as Megatron-LM reduces it:
    a [sum, count] pair is summed over micro-batches and DP ranks, then divided (a token
    mean); a scalar is averaged over micro-batches, then over DP ranks."""
    if not reports or not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    # CP ranks hold parts of the same samples: their [sum, count] add up as DP ranks' do (Megatron-LM);
    # without CP the DP group itself (the same ranks), which perf-report attributes to the loss report
    with_cp = parallel_state.get_context_parallel_world_size() > 1
    group = parallel_state.get_data_parallel_group(with_context_parallel=with_cp)
    out = {}
    for key in reports[0]:
        values = [r[key].float().view(-1) for r in reports]
        if values[0].numel() == 2:
            total = torch.stack(values).sum(dim=0)
            dist.all_reduce(total, group=group)
            out[key] = total[0] / total[1].clamp(min=1)
        else:
            value = torch.cat(values).mean()
            dist.all_reduce(value, group=group)
            out[key] = value / parallel_state.get_data_parallel_world_size(with_context_parallel=with_cp)
    return out


def learning_rates(optimizer: Any) -> tuple[float, float | None]:
    """The schedule's current lr and, with --decoupled-lr, the embedding/output layers' one
    (the groups get_standard_config_overrides() marks is_decoupled_lr, megatron_npu/patches/optimizer.py), as Megatron-LM logs them."""
    default = decoupled = None
    for group in optimizer.param_groups:
        if not group["params"]:
            continue
        if group.get("is_decoupled_lr"):
            decoupled = group["lr"] if decoupled is None else decoupled
        elif default is None:
            default = group["lr"]
    return (default if default is not None else decoupled or 0.0), decoupled


class TrainStep:
    """Model chunks, optimizer and scheduler driven by megatron-core's schedule."""

    def __init__(
        self,
        data: DataSection,
        batches: ScheduleSection,
        parallel: ParallelDims,
        state: RunState,
        model: list,
        optimizer: Any,
        scheduler: Any,
        forward_step: Callable,
        timers: Any,
        *,
        check_for_nan: bool,
    ) -> None:
        self.state = state
        self.seq_length, self.micro_batch_size, self.dp = data.seq_length, batches.micro_batch_size, parallel.dp
        self.model, self.optimizer, self.scheduler, self.timers = model, optimizer, scheduler, timers
        self.forward_step = forward_step
        if check_for_nan:
            self.forward_step = check_forward_step(forward_step, lambda: state.iteration)
        self.schedule = get_forward_backward_func()

    def _iterator(self, iterators: list) -> Any:
        return iterators if len(self.model) > 1 else iterators[0]

    def forward_backward(self, iterators: list, num_microbatches: int, *, forward_only: bool) -> list[dict]:
        """One pass of megatron-core's pipeline schedule over ``num_microbatches`` micro-batches."""
        return self.schedule(
            forward_step_func=self.forward_step,
            data_iterator=self._iterator(iterators),
            model=self.model,
            num_microbatches=num_microbatches,
            seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_size,
            decoder_seq_length=self.seq_length,
            forward_only=forward_only,
        )

    def __call__(self, iterators: list) -> StepResult:
        """Zero the gradients, forward and backward over the step's micro-batches, then the optimizer."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        num_microbatches = get_num_microbatches()
        try:
            reports = self.forward_backward(iterators, num_microbatches, forward_only=False)
        except RuntimeError as error:
            grad_error = non_finite_grad(error, self.state.iteration)
            if grad_error is None:
                raise
            raise grad_error from error
        self.timers("optimizer", log_level=1).start()
        updated, grad_norm, num_zeros = self.optimizer.step()
        self.timers("optimizer").stop()
        if updated:  # the scheduler counts samples
            self.scheduler.step(increment=num_microbatches * self.micro_batch_size * self.dp)
        return StepResult(mean_over_microbatches(reports), updated, grad_norm, num_zeros, num_microbatches)
