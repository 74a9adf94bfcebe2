"""The global batch size of each iteration: constant, ramped up by samples (--rampup-batch-size,
megatron-core's calculator) or stepped by iteration (--step-batch-size-schedule)."""

from __future__ import annotations

import argparse

from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    reconfigure_num_microbatches_calculator,
    update_num_microbatches,
)

from megatron_npu.training.data import global_batch_size_at
from megatron_npu.training.global_vars import print_rank_0
from megatron_npu.training.run_state import RunState


class BatchSizeSchedule:
    """Moves megatron-core's micro-batch calculator to the batch size of the coming iteration."""

    def __init__(self, args: argparse.Namespace, state: RunState) -> None:
        self.args, self.state = args, state

    def advance(self) -> int:
        """The global batch size of iteration ``state.iteration``."""
        args = self.args
        if args.step_batch_size_schedule:
            size = global_batch_size_at(args, self.state.iteration)
            if size != get_current_global_batch_size():
                print_rank_0(
                    f"global batch size {get_current_global_batch_size()} -> {size} at iteration {self.state.iteration}"
                )
                reconfigure_num_microbatches_calculator(args.rank, None, size, args.micro_batch_size, args.parallel.dp)
        else:
            update_num_microbatches(self.state.consumed_train_samples, consistency_check=True)
        return get_current_global_batch_size()
