"""pretrain_gpt.py's flags for a plan: a launch script's flags unchanged, or a Hugging Face config's model
flags (the converter's mapping), read and validated by the trainer's own parser (no torch)."""

from __future__ import annotations

import argparse
import dataclasses

from megatron_npu.layout.memory import model_spec_from_args as memory_model_spec
from megatron_npu.layout.model_spec import ModelSpec
from megatron_npu.layout.plan_cp_fsdp import cp_fsdp_fields
from megatron_npu.layout.planner import ParallelSpec
from megatron_npu.layout.rankmap import RankMap, build_rank_map

# the launcher's short spellings -> pretrain_gpt.py's flags
SHORT_FLAGS = {
    "--tp": "--tensor-model-parallel-size",
    "--pp": "--pipeline-model-parallel-size",
    "--cp": "--context-parallel-size",
    "--ep": "--expert-model-parallel-size",
    "--etp": "--expert-tensor-parallel-size",
    "--vpp": "--num-virtual-stages-per-pipeline-rank",
}
DTYPE_FLAGS = {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}
# what the plan fills in when a launch script's data and length flags are absent (no bytes depend on them)
FILLERS = {
    ("--train-iters", "--train-samples"): ["--train-iters", "1"],
    ("--data-path", "--mock-data", "--train-data-path", "--per-split-data-args-path"): ["--mock-data"],
    ("--lr",): ["--lr", "1e-4"],
    ("--micro-batch-size",): ["--micro-batch-size", "1"],  # Megatron-LM requires it; --search chooses its own
}
DTYPE_SWITCHES = ("--bf16", "--fp16")


def trainer_argv(a: argparse.Namespace, rest: list[str]) -> list[str]:
    """pretrain_gpt.py's flags: the Hugging Face config's model flags, the given ones, the short spellings."""
    argv: list[str] = []
    if a.hf_config:
        from megatron_npu.convert.hf_config import model_spec, read_config

        spec = model_spec(read_config(a.hf_config))
        given_dtype = a.dtype is not None or any(tok in DTYPE_SWITCHES for tok in rest)
        # the user's --bf16 / --fp16 / --dtype overrides the config's torch_dtype
        flags = [tok for tok in spec.flags() if not (given_dtype and tok in DTYPE_SWITCHES)]
        argv += [*flags, "--vocab-size", str(spec.vocab_size)]
    argv += rest
    for short, long in SHORT_FLAGS.items():
        value = getattr(a, short[2:])
        if value is not None:
            argv += [long, str(value)]
    if a.dtype is not None:
        argv += DTYPE_FLAGS[a.dtype]
    return argv


def with_fillers(argv: list[str]) -> list[str]:
    given = {tok.split("=", 1)[0] for tok in argv if tok.startswith("--")}
    out = list(argv)
    for names, filler in FILLERS.items():
        if not given & set(names):
            out += filler
    return out


def parse_trainer_args(argv: list[str], world_size: int) -> argparse.Namespace:
    """The trainer's own parser and validation (no torch; paths and the machine not checked)."""
    from megatron_npu.training.arguments import parse_args

    return parse_args(with_fillers(argv), world_size=world_size, check_paths=False, check_target=False)


def rank_map_for(args: argparse.Namespace, a: argparse.Namespace) -> RankMap:
    return with_stage_split(_rank_map(args, a), args)


def with_stage_split(rmap: RankMap, args: argparse.Namespace) -> RankMap:
    """The rank map with the run's uneven first / last pipeline stages (where ParallelDims has them)."""
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    if first is None and last is None:
        return rmap
    dims = dataclasses.replace(rmap.dims, first_stage_layers=first, last_stage_layers=last)
    return dataclasses.replace(rmap, dims=dims)


def _rank_map(args: argparse.Namespace, a: argparse.Namespace) -> RankMap:
    return build_rank_map(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        cp=args.context_parallel_size,
        ep=args.expert_model_parallel_size,
        vpp=args.virtual_pipeline_model_parallel_size,
        nnodes=a.nnodes,
        nproc_per_node=a.nproc_per_node,
        hosts=a.hosts.split(",") if a.hosts else None,
        etp=args.expert_tensor_parallel_size,
        num_experts=args.num_experts,
    )


def specs_from_args(args: argparse.Namespace) -> tuple[ModelSpec, ParallelSpec]:
    """The planner's inputs from pretrain_gpt.py's validated settings."""
    model = memory_model_spec(args)
    par = ParallelSpec(
        sequence_parallel=bool(args.sequence_parallel),
        use_distributed_optimizer=bool(args.use_distributed_optimizer),
        overlap_grad_reduce=bool(args.overlap_grad_reduce),
        bucket_size=args.ddp_bucket_size,
        clip_grad=args.clip_grad,
        recompute_full=args.recompute_granularity == "full",
        per_token_loss=bool(args.calculate_per_token_loss),
        **cp_fsdp_fields(args),
    )
    return model, par
