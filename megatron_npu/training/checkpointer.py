"""The trainer's checkpoint component: when to save, and what saving and loading touch besides
the files (checkpointing.py writes and reads those)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

from megatron_npu.training import checkpointing
from megatron_npu.training.checkpoint_format import CheckpointedRun
from megatron_npu.training.faults import FaultPlan
from megatron_npu.training.global_vars import print_rank_0
from megatron_npu.training.run_state import RunState
from megatron_npu.training.sections import CheckpointSection


class Checkpointer:
    """--save every --save-interval and at the end of the run, --load at the start.

    ``checkpoint``: when, where and what; ``run``: what a save records of the model and optimizer and a load
    checks; ``overlap_param_gather``: the weights are gathered before a save. ``args_record``: every flag and
    derived value by its Megatron-LM name (``Settings.values()``), read for nothing but the checkpoint's
    ``args`` record (Megatron-LM's format stores the whole namespace; its loader compares it with its run's)."""

    def __init__(
        self,
        checkpoint: CheckpointSection,
        run: CheckpointedRun,
        state: RunState,
        model: list,
        optimizer: Any,
        scheduler: Any,
        faults: FaultPlan | None,
        *,
        overlap_param_gather: bool,
        args_record: Mapping[str, Any],
    ) -> None:
        self.checkpoint, self.run, self.state, self.args_record = checkpoint, run, state, args_record
        self.overlap_param_gather = overlap_param_gather
        self.model, self.optimizer, self.scheduler, self.faults = model, optimizer, scheduler, faults
        self.saved_iteration: int | None = None
        self.first_iteration = 0
        # --async-save: megatron-core's queue of writes in flight (a forked writer per save, its default)
        self.async_queue = AsyncCallsQueue() if checkpoint.async_save else None

    @functools.cached_property
    def save_strategy(self) -> FullyParallelSaveStrategyWrapper | None:
        """--ckpt-fully-parallel-save (the default): the DP ranks share the writing of replicated shards. Built at
        the first save (it needs the DP group), kept for the others, as Megatron-LM keeps it."""
        return checkpointing.save_strategy(self.checkpoint)

    def clean_unfinished(self) -> None:
        """A save killed part-way leaves ``iter_N.partial``: removed (and said) before anything else."""
        if self.checkpoint.save:
            checkpointing.clean_unfinished_saves(self.checkpoint.save)

    def load(self) -> None:
        """Start-up: --load into the model, optimizer, scheduler and RNG; the run state takes the saved counters.
        Then, for the saves to come, the process megatron-core's writers report through is started (not
        inside the first save's stall)."""
        if self.checkpoint.load:
            loaded = checkpointing.load_checkpoint(
                self.model, self.optimizer, self.scheduler, self.checkpoint, self.run
            )
            self.state.load_state_dict(loaded.state_dict())
        self.first_iteration = self.state.iteration
        if self.checkpoint.save and self.checkpoint.ckpt_format == "torch_dist":
            checkpointing.start_save_service()

    def due(self, iteration: int) -> bool:
        checkpoint = self.checkpoint
        return bool(checkpoint.save and checkpoint.save_interval and iteration % checkpoint.save_interval == 0)

    def save(self) -> None:
        """Save the current iteration (atomically: checkpointing.save_checkpoint)."""
        overlap = self.overlap_param_gather
        if overlap:  # saved weights must be the gathered, updated ones
            for chunk in self.model:
                chunk.disable_forward_pre_hook(param_sync=True)
        in_save = self.faults.fire_in_save if self.faults else None
        checkpointing.save_checkpoint(
            self.state,
            self.model,
            self.optimizer,
            self.scheduler,
            self.checkpoint,
            self.run,
            self.args_record,
            in_save,
            self.async_queue,
            self.save_strategy,
        )
        if overlap:
            for chunk in self.model:
                chunk.enable_forward_pre_hook()
        self.saved_iteration = self.state.iteration

    def save_last(self) -> None:
        """The last iteration trained is always on disk (Megatron-LM does the same)."""
        trained = self.state.iteration > self.first_iteration
        if self.checkpoint.save and trained and self.saved_iteration != self.state.iteration:
            self.save()
        self.wait_for_saves()

    def publish_finished(self) -> None:
        """--async-save, every iteration on every rank: publish the saves every rank has written."""
        if self.async_queue is not None:
            self.async_queue.maybe_finalize_async_calls(blocking=False)

    def wait_for_saves(self) -> None:
        """--async-save: the writes still running finish and are published before the run ends."""
        if self.async_queue is not None:
            if self.async_queue.get_num_unfinalized_calls():
                print_rank_0("waiting for the asynchronous checkpoint saves still being written")
            self.async_queue.maybe_finalize_async_calls(blocking=True)
            self.async_queue.close()
