"""Process groups, seeds, microbatch calculator and the layout record of a run.

Everything here happens after the arguments passed every check: a bad layout has
already exited on every rank before any process group exists.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

from megatron_npu.accelerator import get_accelerator


def initialize_distributed(args: argparse.Namespace) -> None:
    accelerator = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if accelerator.device_count() > 0:
        accelerator.set_device(local_rank % accelerator.device_count())
    if not dist.is_initialized():
        dist.init_process_group(
            # --distributed-backend through the accelerator (parse_args refused what it cannot run)
            backend=accelerator.collective_backend_for(getattr(args, "distributed_backend", None)),
            timeout=timedelta(minutes=args.distributed_timeout_minutes),
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    # args.rank and args.world_size were read from torchrun's environment at validation: the same values
    rampup = [int(value) for value in args.rampup_batch_size] if args.rampup_batch_size else None
    first_batch = args.schedule.global_batch_size_at(1)
    init_num_microbatches_calculator(args.rank, rampup, first_batch, args.micro_batch_size, args.parallel.dp)


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


def write_run_files(args: argparse.Namespace) -> None:
    """LOG_DIR/layout.json (the groups as built) and LOG_DIR/args.json (every argument)."""
    if not args.log_dir:  # the same on every rank: none of them gathers
        return
    record = layout_record()
    if dist.get_rank() == 0:
        os.makedirs(args.log_dir, exist_ok=True)
        with open(os.path.join(args.log_dir, "layout.json"), "w") as f:
            json.dump(record, f, indent=1)
        with open(os.path.join(args.log_dir, "args.json"), "w") as f:
            json.dump(args.values(), f, indent=1, default=str)
