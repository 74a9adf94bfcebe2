"""The global batch size of each iteration: constant, ramped up by samples (--rampup-batch-size,
megatron-core's calculator) or stepped by iteration (--step-batch-size-schedule)."""

from __future__ import annotations

from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    reconfigure_num_microbatches_calculator,
    update_num_microbatches,
)

from megatron_npu.layout.parallel_dims import ParallelDims
from megatron_npu.training.global_vars import print_rank_0
from megatron_npu.training.run_state import RunState
from megatron_npu.training.sections import ScheduleSection


class BatchSizeSchedule:
    """Moves megatron-core's micro-batch calculator to the batch size of the coming iteration."""

    def __init__(self, schedule: ScheduleSection, parallel: ParallelDims, state: RunState, rank: int) -> None:
        self.schedule, self.parallel, self.state, self.rank = schedule, parallel, state, rank

    def advance(self) -> int:
        """The global batch size of iteration ``state.iteration``."""
        schedule, iteration = self.schedule, self.state.iteration
        if schedule.step_batch_size_schedule:
            size = schedule.global_batch_size_at(iteration)
            if size != get_current_global_batch_size():
                print_rank_0(f"global batch size {get_current_global_batch_size()} -> {size} at iteration {iteration}")
                reconfigure_num_microbatches_calculator(
                    self.rank, None, size, schedule.micro_batch_size, self.parallel.dp
                )
        else:
            update_num_microbatches(self.state.consumed_train_samples, consistency_check=True)
        return get_current_global_batch_size()
