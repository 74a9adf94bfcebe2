"""Evaluation: forward-only passes over the validation or test split, Megatron-LM's lines."""

from __future__ import annotations

import torch

from megatron_npu.layout.parallel_dims import ParallelDims
from megatron_npu.training.global_vars import print_rank_last
from megatron_npu.training.reporting import MetricsWriter, validation_lines
from megatron_npu.training.run_state import RunState
from megatron_npu.training.sections import ScheduleSection
from megatron_npu.training.step import TrainStep, mean_over_microbatches


class Validator:
    """--eval-iters global batches per evaluation; the validation stream's position is run state
    (a resumed run continues it), the test split is read from its start once, at the end."""

    def __init__(self, schedule: ScheduleSection, parallel: ParallelDims, state: RunState, step: TrainStep) -> None:
        self.schedule, self.state, self.step = schedule, state, step
        self.num_microbatches = parallel.microbatches(schedule.global_batch_size, schedule.micro_batch_size)

    def due(self, iteration: int) -> bool:
        return bool(self.schedule.eval_interval) and iteration % self.schedule.eval_interval == 0

    def losses(self, iterators: list, *, advance_position: bool) -> dict[str, float]:
        """The mean of each reported loss over --eval-iters global batches."""
        eval_iters = self.schedule.eval_iters
        for chunk in self.step.model:
            chunk.eval()
        totals: dict[str, float] = {}
        with torch.no_grad():
            for _ in range(eval_iters):
                reports = self.step.forward_backward(iterators, self.num_microbatches, forward_only=True)
                for key, value in mean_over_microbatches(reports).items():
                    totals[key] = totals.get(key, 0.0) + value.item() / eval_iters
                if advance_position:  # the resumable position of the validation stream
                    self.state.consumed_valid_samples += self.schedule.global_batch_size
        for chunk in self.step.model:
            chunk.train()
        return totals

    def run(self, iterators: list, prefix: str, metrics: MetricsWriter, split: str = "validation") -> None:
        """Evaluate ``split`` ("validation" or "test"), print Megatron-LM's lines, record the losses."""
        losses = self.losses(iterators, advance_position=split == "validation")
        print_rank_last(validation_lines(prefix, losses))
        metrics.evaluation(self.state.iteration, self.state.consumed_train_samples, losses, split)
