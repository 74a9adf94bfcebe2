"""Process groups, seeds, microbatch calculator and the layout record of a run.

Everything here happens after the arguments passed every check: a bad layout has
already exited on every rank before any process group exists.
"""

from __future__ import annotations

import json
import os
import random
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

from megatron_npu.accelerator import get_accelerator
from megatron_npu.layout.parallel_dims import ParallelDims
from megatron_npu.training.sections import DistributedSection, ScheduleSection


def initialize_distributed(distributed: DistributedSection, parallel: ParallelDims, schedule: ScheduleSection) -> None:
    """The default process group (--distributed-backend through the accelerator), megatron-core's
    model-parallel groups for the validated layout, and the micro-batch calculator."""
    accelerator = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if accelerator.device_count() > 0:
        accelerator.set_device(local_rank % accelerator.device_count())
    if not dist.is_initialized():
        dist.init_process_group(
            # --distributed-backend through the accelerator (parse_args refused what it cannot run)
            backend=accelerator.collective_backend_for(distributed.distributed_backend),
            timeout=timedelta(minutes=distributed.distributed_timeout_minutes),
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        hierarchical_context_parallel_sizes=distributed.hierarchical_context_parallel_sizes,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
        distributed_timeout_minutes=distributed.distributed_timeout_minutes,
    )
    # the process group's rank: torchrun's $RANK, which validation read as args.rank
    rampup = [int(value) for value in schedule.rampup_batch_size] if schedule.rampup_batch_size else None
    first_batch = schedule.global_batch_size_at(1)
    init_num_microbatches_calculator(dist.get_rank(), rampup, first_batch, schedule.micro_batch_size, parallel.dp)


def set_random_seed(seed: int, data_parallel_random_init: bool = False) -> None:
    """Megatron-LM's seeding: distinct per pipeline stage, and per DP rank when asked."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed += 10 * parallel_state.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def layout_record() -> dict:
    """This run's ranks and groups as parallel_state built them (rank map format)."""
    me = {
        "rank": dist.get_rank(),
        "node": int(os.environ.get("GROUP_RANK", 0)),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "host": socket.gethostname(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "cp_rank": parallel_state.get_context_parallel_rank(),
        "groups": {
            "tp": dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()),
            "pp": dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()),
            "dp": dist.get_process_group_ranks(parallel_state.get_data_parallel_group()),
            "cp": dist.get_process_group_ranks(parallel_state.get_context_parallel_group()),
        },
    }
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    groups: dict[str, list[list[int]]] = {}
    for entry in everyone:
        for name, ranks in entry.pop("groups").items():
            if ranks not in groups.setdefault(name, []):
                groups[name].append(ranks)
    return {"world_size": dist.get_world_size(), "ranks": everyone, "groups": {k: sorted(v) for k, v in groups.items()}}


def write_run_files(log_dir: str | None, run_flags: Mapping[str, Any]) -> None:
    """LOG_DIR/layout.json (the groups as built) and LOG_DIR/args.json: ``run_flags``, every flag and
    derived value by Megatron-LM's name (``Settings.values()``), the record perf-report rebuilds a run from."""
    if not log_dir:  # the same on every rank: none of them gathers
        return
    record = layout_record()
    if dist.get_rank() == 0:
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, "layout.json"), "w") as f:
            json.dump(record, f, indent=1)
        with open(os.path.join(log_dir, "args.json"), "w") as f:
            json.dump(run_flags, f, indent=1, default=str)
