"""Per-iteration metrics: one record per step, written to every sink from that one record.

The record feeds the timers' JSON lines, metrics.jsonl / TensorBoard / wandb (MetricsWriter) and,
averaged over --log-interval, Megatron-LM's iteration line.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_npu.accelerator import get_accelerator
from megatron_npu.layout.parallel_dims import ParallelDims
from megatron_npu.training.global_vars import print_rank_last
from megatron_npu.training.reporting import MetricsWriter, ModelFlops, iteration_line, moe_losses
from megatron_npu.training.run_state import RunState
from megatron_npu.training.sections import LoggingSection, ModelSection, MoeSection
from megatron_npu.training.step import StepResult, learning_rates
from megatron_npu.training.timing import TimerLog


@dataclasses.dataclass
class StepRecord:
    """One iteration's figures, as every sink reports them."""

    iteration: int
    consumed_samples: int
    losses: dict[str, float]
    learning_rate: float
    decoupled_learning_rate: float | None
    global_batch_size: int
    loss_scale: float
    grad_norm: float | None
    num_zeros: int | None
    updated: bool
    num_microbatches: int
    iteration_s: float
    flops: float
    throughput_tflops: float
    skipped_iterations: int
    nan_iterations: int

    def metrics_json(self) -> dict[str, Any]:
        """The metrics.jsonl fields (besides iteration and consumed samples), by their names."""
        return {
            "lm_loss": self.losses.get("lm loss"),
            **{name: value for name, value in self.losses.items() if name != "lm loss"},
            "learning_rate": self.learning_rate,
            "decoupled_learning_rate": self.decoupled_learning_rate,
            "global_batch_size": self.global_batch_size,
            "loss_scale": self.loss_scale,
            "grad_norm": self.grad_norm,
            "iteration_s": self.iteration_s,
            "throughput_tflops": self.throughput_tflops,
            "skipped_iterations": self.skipped_iterations,
            "nan_iterations": self.nan_iterations,
        }


@dataclasses.dataclass
class _Interval:
    """Sums over the iterations since the last iteration line."""

    time: float = 0.0
    iters: int = 0
    flops: float = 0.0
    losses: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, record: StepRecord) -> None:
        self.time += record.iteration_s
        self.iters += 1
        self.flops += record.flops
        for key, value in record.losses.items():
            if math.isfinite(value):
                self.losses[key] = self.losses.get(key, 0.0) + value


def mtp_losses(num_microbatches: int, iteration: int, writer: Any) -> dict[str, float]:
    """This iteration's multi-token prediction losses ("mtp_1 loss", ...), as Megatron-LM's training_log
    reads megatron-core's tracker (scaled by 1 / micro-batches, averaged over DP, then cleared); only
    the ranks holding the MTP layers have them (the last rank prints the iteration line)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    totals: dict[str, Any] = {}
    MTPLossLoggingHelper.track_mtp_metrics(1 / num_microbatches, iteration, writer, None, totals)
    return {name: float(value) for name, value in totals.items()}


class TrainingMetrics:
    """Builds each step's record and writes it: timers JSON, metrics sinks, the iteration line.

    ``writer``: the metrics sinks (MetricsWriter, last rank); ``flops``: the model's FLOPs per step;
    ``params_dtype``: the peak the MFU is measured against; ``moe``: the aux losses to track (MoE runs)."""

    def __init__(
        self,
        logging: LoggingSection,
        model: ModelSection,
        parallel: ParallelDims,
        state: RunState,
        optimizer: Any,
        timers: Any,
        train_iters: int,
        *,
        writer: MetricsWriter,
        flops: ModelFlops,
        params_dtype: torch.dtype,
        moe: MoeSection | None,
    ):
        self.logging, self.model, self.parallel = logging, model, parallel
        self.state, self.optimizer, self.train_iters = state, optimizer, train_iters
        self.flops, self.moe, self.writer = flops, moe, writer
        self.timer_log = TimerLog(timers, logging.log_dir, dist.get_rank(), logging.timing_log_level)
        self.peak = get_accelerator().peak_tflops(params_dtype)
        self.interval = _Interval()

    def account(self, result: StepResult, batch_size: int, elapsed: float) -> StepRecord:
        """Count the step in the run state (samples, skipped and NaN iterations) and build its record;
        the MoE aux losses are reduced on every rank (the tracker's collective)."""
        state, world_size = self.state, self.parallel.world_size
        losses = {key: value.item() for key, value in result.losses.items()}
        if self.moe is not None:
            losses |= moe_losses(
                self.moe, self.model, result.num_microbatches, state.iteration, self.writer.tensorboard
            )
        if self.model.mtp_num_layers:
            losses |= mtp_losses(result.num_microbatches, state.iteration, self.writer.tensorboard)
        state.count_step(batch_size, updated=result.updated, finite=all(math.isfinite(v) for v in losses.values()))
        flops = self.flops.per_iteration(batch_size)
        state.floating_point_operations_so_far += flops
        lr, decoupled_lr = learning_rates(self.optimizer)
        return StepRecord(
            iteration=state.iteration,
            consumed_samples=state.consumed_train_samples,
            losses=losses,
            learning_rate=lr,
            decoupled_learning_rate=decoupled_lr,
            global_batch_size=batch_size,
            loss_scale=self.optimizer.get_loss_scale().item(),
            grad_norm=result.grad_norm,
            num_zeros=result.num_zeros,
            updated=result.updated,
            num_microbatches=result.num_microbatches,
            iteration_s=elapsed,
            flops=flops,
            throughput_tflops=flops / (elapsed * 1e12 * world_size),
            skipped_iterations=state.skipped_iterations,
            nan_iterations=state.nan_iterations,
        )

    def write(self, record: StepRecord) -> None:
        """Every sink, and the iteration line every --log-interval."""
        self.timer_log.write(
            record.iteration,
            record.iteration_s,
            {
                "num_microbatches": record.num_microbatches,
                "updated": record.updated,
                "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "dp_rank": parallel_state.get_data_parallel_rank(),
            },
        )
        self.writer.train(record.iteration, record.consumed_samples, record.metrics_json())
        self.interval.add(record)
        if record.iteration % self.logging.log_interval == 0:
            print_rank_last(self._iteration_line(record))
            self.interval = _Interval()

    def _iteration_line(self, record: StepRecord) -> str:
        interval, log_throughput = self.interval, self.logging.log_throughput
        tflops = interval.flops / (interval.time * 1e12 * self.parallel.world_size)
        return iteration_line(
            iteration=record.iteration,
            train_iters=self.train_iters,
            consumed_samples=record.consumed_samples,
            elapsed_s=interval.time / interval.iters,
            throughput_tflops=tflops if log_throughput else None,
            mfu=tflops / self.peak if (self.peak and log_throughput) else None,
            learning_rate=record.learning_rate,
            decoupled_learning_rate=record.decoupled_learning_rate,
            global_batch_size=record.global_batch_size,
            losses={key: value / interval.iters for key, value in interval.losses.items()},
            loss_scale=record.loss_scale,
            grad_norm=record.grad_norm,
            num_zeros=record.num_zeros,
            skipped=record.skipped_iterations,
            nans=record.nan_iterations,
        )

    def end_of_iteration(self) -> None:
        """Timers not written this iteration (evaluation, checkpoint) are dropped."""
        self.timer_log.discard()

    def close(self) -> None:
        self.timer_log.close()
        self.writer.close()
