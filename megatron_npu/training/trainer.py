"""The training loop as named steps over small components (in the spirit of torchtitan's trainer):
the step (step.py), metrics (metrics.py), evaluation (evaluation.py), checkpoints
(checkpointer.py), the batch-size schedule, the profiler and the exit policy. The settings are read
only; what the loop advances is ``RunState``."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from megatron_npu.accelerator import get_accelerator
from megatron_npu.training.batch_schedule import BatchSizeSchedule
from megatron_npu.training.checkpoint_format import CheckpointedRun
from megatron_npu.training.checkpointer import Checkpointer
from megatron_npu.training.config import params_dtype
from megatron_npu.training.evaluation import Validator
from megatron_npu.training.exit_policy import ExitPolicy
from megatron_npu.training.faults import FaultPlan
from megatron_npu.training.garbage_collection import GarbageCollection
from megatron_npu.training.global_vars import print_rank_0
from megatron_npu.training.memory_report import reported_step
from megatron_npu.training.metrics import StepRecord, TrainingMetrics
from megatron_npu.training.profiler import StepProfiler
from megatron_npu.training.reporting import MetricsWriter, ModelFlops
from megatron_npu.training.run_state import RunState
from megatron_npu.training.sections import LoggingSection
from megatron_npu.training.settings import Settings
from megatron_npu.training.step import TrainStep


class Trainer:
    """One run: its components over the model chunks, optimizer and scheduler."""

    def __init__(
        self,
        settings: Settings,
        state: RunState,
        model: list,
        optimizer: Any,
        scheduler: Any,
        forward_step: Callable,
        timers: Any,
    ) -> None:
        # the composition root: each component gets its own sections; the flat settings go on only
        # where Megatron-LM's format needs all of them (the checkpoint's args, wandb's config)
        self.state, self.schedule = state, settings.schedule
        # every flag's value by Megatron-LM's name: wandb's config, the memory model's input (args.json's record)
        self.run_flags = settings.values()
        self.faults = FaultPlan.from_env()
        self.step = TrainStep(
            settings.data,
            settings.schedule,
            settings.parallel,
            state,
            model,
            optimizer,
            scheduler,
            forward_step,
            timers,
            check_for_nan=settings.check_for_nan_in_loss_and_grad,
        )
        self.checkpointer = Checkpointer(
            settings.checkpoint,
            CheckpointedRun.from_sections(
                settings.model,
                settings.distributed,
                settings.init,
                settings.fsdp,
                padded_vocab_size=settings.padded_vocab_size,
            ),
            state,
            model,
            optimizer,
            scheduler,
            self.faults,
            overlap_param_gather=settings.distributed.overlap_param_gather,
            args_record=self.run_flags,
        )
        self.validator = Validator(settings.schedule, settings.parallel, state, self.step)
        self.batch_schedule = BatchSizeSchedule(settings.schedule, settings.parallel, state, settings.rank)
        self.profiler = StepProfiler(settings.profiling, settings.logging.log_dir)
        self.garbage_collection = GarbageCollection(settings.training)
        self.train_iters = settings.schedule.total_iterations()
        # the per-step records (training_metrics), built when training starts: their writer opens the sinks then
        self.new_writer = functools.partial(metrics_writer, settings.logging, settings.checkpoint.save, self.run_flags)
        self.new_metrics = functools.partial(
            TrainingMetrics,
            settings.logging,
            settings.model,
            settings.parallel,
            state,
            optimizer,
            timers,
            self.train_iters,
            flops=ModelFlops(settings.model, settings.data.seq_length, settings.padded_vocab_size),
            params_dtype=params_dtype(settings.precision),
            moe=settings.moe if settings.moe.num_experts is not None else None,
        )
        # --memory-report: where the first step's measurement goes (None: not measured)
        self.memory_report_dir = settings.logging.log_dir if settings.profiling.memory_report else None

    def train(self, train_iterators: list, valid_iterators: list | None) -> None:
        """Steps until --train-iters (or an exit condition), with evaluations and saves between them."""
        state = self.state
        metrics = self.training_metrics()
        with ExitPolicy(self.schedule) as exit_policy, self.garbage_collection as collector:
            while state.iteration < self.train_iters:
                state.iteration += 1
                metrics.write(self.train_one_step(train_iterators, metrics))
                if valid_iterators is not None and self.validator.due(state.iteration):
                    collector.before_evaluation()
                    self.validator.run(valid_iterators, f"at iteration {state.iteration}", metrics.writer)
                    collector.after_evaluation()
                self.checkpointer.publish_finished()
                if self.checkpointer.due(state.iteration):
                    self.checkpointer.save()
                metrics.end_of_iteration()
                collector.after_step(state.iteration)
                state.exit_reason = exit_policy.reason(state.iteration)
                if state.exit_reason:
                    print_rank_0(f"exiting program {state.exit_reason}")
                    break
            self.checkpointer.save_last()
        metrics.close()

    def training_metrics(self) -> TrainingMetrics:
        """The per-step records' builder and its sinks."""
        return self.new_metrics(writer=self.new_writer())

    def train_one_step(self, iterators: list, metrics: TrainingMetrics) -> StepRecord:
        """Iteration ``state.iteration``: its batch size, the step (timed, maybe profiled), its record."""
        iteration, accelerator = self.state.iteration, get_accelerator()
        if self.faults:
            self.faults.fire(iteration, self.step.model)
        batch_size = self.batch_schedule.advance()
        self.profiler.before(iteration)
        accelerator.synchronize()
        started = time.perf_counter()
        # --memory-report: the first step measured
        result = reported_step(self.step, iterators, self.memory_report_dir, self.run_flags)
        accelerator.synchronize()
        elapsed = time.perf_counter() - started
        self.profiler.after(iteration)
        return metrics.account(result, batch_size, elapsed)


def metrics_writer(logging: LoggingSection, save: str | None, run_flags: Mapping[str, Any]) -> MetricsWriter:
    """metrics.jsonl / TensorBoard / wandb on the last rank (``save``: wandb's default directory;
    ``run_flags``: every flag's value, wandb's config)."""
    is_last_rank = dist.get_rank() == dist.get_world_size() - 1
    return MetricsWriter(logging, is_last_rank, save=save, run_flags=run_flags)
