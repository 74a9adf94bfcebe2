"""Megatron-LM core_v0.16.1's FSDP combination rules (``validate_args``), each a one-line ConfigError
naming the flag, raised before any process group exists (the flags are ``sections/fsdp.py``'s ``FsdpSection``).

Two implementations, as in Megatron-LM: ``--use-megatron-fsdp`` (megatron-core's Megatron-FSDP,
sharding by ``--data-parallel-sharding-strategy``; its checkpoints are ``--ckpt-format
fsdp_dtensor``) and ``--use-torch-fsdp2`` (torch's ``fully_shard`` through megatron-core's
TorchFullyShardedDataParallel; saved ``--ckpt-format torch_dist``, as Megatron-LM saves it). The FSDP
flags this trainer cannot honour (HSDP, NCCL user buffers, double buffering) are refused by ``policy.py``'s rows.
"""

from __future__ import annotations

import argparse

from ..policy import ConfigError
from .sections.fsdp import SHARDING_STRATEGIES

__all__ = ["MEGATRON_FSDP_FORMAT", "SHARDING_STRATEGIES", "check_fsdp_args", "uses_fsdp"]

MEGATRON_FSDP_FORMAT = "fsdp_dtensor"


def uses_fsdp(args: argparse.Namespace) -> bool:
    return bool(args.use_megatron_fsdp or args.use_torch_fsdp2)


def check_fsdp_args(args: argparse.Namespace) -> None:
    """Megatron-LM core_v0.16.1's FSDP rules, plus what megatron-core needs to run them here."""
    if args.use_megatron_fsdp and args.use_torch_fsdp2:
        raise ConfigError("--use-megatron-fsdp and --use-torch-fsdp2 are two FSDP implementations: pick one")
    if args.ckpt_format == MEGATRON_FSDP_FORMAT and not args.use_megatron_fsdp:
        raise ConfigError("--ckpt-format fsdp_dtensor is Megatron-FSDP's checkpoint format: add --use-megatron-fsdp")
    if args.use_torch_fsdp2:
        _check_torch_fsdp2(args)
    if args.use_megatron_fsdp:
        _check_megatron_fsdp(args)
        args.use_custom_fsdp = True  # as Megatron-LM: the deprecated name megatron-core still reads


def _check_torch_fsdp2(args: argparse.Namespace) -> None:
    rules = (
        (args.pipeline_model_parallel_size == 1, "is not supported with pipeline parallelism: drop it or use PP 1"),
        (args.expert_model_parallel_size == 1, "is not supported with expert parallelism: use EP 1"),
        (
            not args.use_distributed_optimizer,
            "is not supported with megatron-core's distributed optimizer (FSDP2 shards the optimizer state "
            "itself): drop --use-distributed-optimizer",
        ),
        (args.ckpt_format == "torch_dist", "saves --ckpt-format torch_dist: drop --ckpt-format or give torch_dist"),
        (args.untie_embeddings_and_output_weights, "requires --untie-embeddings-and-output-weights"),
        (not args.fp16, "is not supported with --fp16: use --bf16"),
        (args.context_parallel_size == 1, "is not supported with context parallelism by this trainer: use CP 1"),
    )
    for holds, why in rules:
        if not holds:
            raise ConfigError(f"--use-torch-fsdp2 {why}")
    # Megatron-LM refuses the fused wgrad accumulation under FSDP2 (it writes .main_grad, which FSDP2's
    # parameters lack); here it is on by default and used only where apex's kernel imports: off
    args.gradient_accumulation_fusion = False


def _check_megatron_fsdp(args: argparse.Namespace) -> None:
    strategy = args.data_parallel_sharding_strategy
    rules = (
        (
            args.ckpt_format == MEGATRON_FSDP_FORMAT,
            "saves only --ckpt-format fsdp_dtensor (as Megatron-LM): add --ckpt-format fsdp_dtensor",
        ),
        (
            args.use_distributed_optimizer,
            "shards the optimizer state through megatron-core's distributed optimizer: add --use-distributed-optimizer",
        ),
        (
            args.pipeline_model_parallel_size == 1,
            "is not supported with pipeline parallelism: megatron-core 0.16.1's Megatron-FSDP lays its device mesh "
            "over DP x TP of the whole world (Megatron-LM fails at wrap time): use PP 1",
        ),
        (not args.fp16, "is not supported with --fp16 by this trainer: use --bf16"),
        (
            strategy != "optim_grads_params" or args.check_weight_hash_across_dp_replicas_interval is None,
            "--data-parallel-sharding-strategy optim_grads_params shards the weights: drop "
            "--check-weight-hash-across-dp-replicas-interval",
        ),
    )
    for holds, why in rules:
        if not holds:
            raise ConfigError(f"--use-megatron-fsdp {why}")
