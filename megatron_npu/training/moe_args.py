"""Megatron-LM core_v0.16.1's Mixture-of-Experts rules: what megatron-core's TransformerConfig and MoE layers
would assert after initialisation, checked before any process group (the flags are ``sections/moe.py``'s
``MoeSection``).
"""

from __future__ import annotations

import argparse

from ..layout.moe import moe_freq_type
from ..policy import ConfigError

__all__ = ["check_moe_args", "moe_freq_type"]


# load-balancing types megatron-core's capacity factor works with (TransformerConfig.__post_init__)
_CAPACITY_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


def check_moe_args(args: argparse.Namespace) -> None:
    """megatron-core 0.16.1's MoE checks, before any process group: TransformerConfig.__post_init__
    raises them as a traceback after initialisation, megatron/core/transformer/moe/* as an assertion
    inside the first forward. ``args`` is a MoE model's, after Megatron-LM's list collapsing."""
    types = args.moe_router_load_balancing_type
    types = types if isinstance(types, list) else [types]
    coeff = args.moe_aux_loss_coeff
    if len(types) > 1 and not (isinstance(coeff, list) and len(coeff) == len(types)):
        raise ConfigError(
            f"--moe-router-load-balancing-type gives {len(types)} types; --moe-aux-loss-coeff needs one "
            f"coefficient per type ({len(types)} values)"
        )
    if "sinkhorn" in types and any(c != 0 for c in (coeff if isinstance(coeff, list) else [coeff])):
        raise ConfigError(
            "--moe-router-load-balancing-type sinkhorn balances without an aux loss: set --moe-aux-loss-coeff 0"
        )
    size = args.moe_shared_expert_intermediate_size
    if size is not None and size <= 0:
        raise ConfigError(
            f"--moe-shared-expert-intermediate-size must be positive (shared experts x their FFN size), got {size}"
        )
    if args.moe_expert_capacity_factor is not None and args.moe_expert_capacity_factor < 0:
        args.moe_expert_capacity_factor = None  # megatron-core: a negative capacity factor means none
    if args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is None:
        raise ConfigError("--moe-pad-expert-input-to-capacity needs a --moe-expert-capacity-factor >= 0")
    if args.moe_expert_capacity_factor is not None and not set(types) <= set(_CAPACITY_BALANCING):
        raise ConfigError(
            f"--moe-expert-capacity-factor works with --moe-router-load-balancing-type "
            f"{', '.join(_CAPACITY_BALANCING)}; not {' '.join(types)}"
        )
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        raise ConfigError(
            "--moe-router-enable-expert-bias (aux-loss-free balancing) needs --moe-router-score-function sigmoid"
        )
    if (
        args.moe_router_topk == 1
        and args.moe_router_score_function == "softmax"
        and not args.moe_router_pre_softmax
        and types != ["sinkhorn"]
    ):
        # a softmax over the one selected score is 1: its gradient is zero
        raise ConfigError("--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax")
    _check_group_limited_routing(args)
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        # megatron-core's MoELayer raises it in the first training forward
        raise ConfigError(
            f"--num-experts with --tensor-model-parallel-size {args.tensor_model_parallel_size} needs "
            "--sequence-parallel (megatron-core's MoE layer refuses TP without it)"
        )
    if args.recompute_modules and "moe_act" in args.recompute_modules:
        # megatron-core recomputes the expert activation only in its grouped modules (CUDA grouped_gemm
        # or Transformer Engine); this trainer's experts are SequentialMLP-based, grouped or not
        raise ConfigError("--recompute-modules moe_act is not supported by this trainer's experts; use 'moe'")


def _check_group_limited_routing(args: argparse.Namespace) -> None:
    """Group-limited routing (DeepSeek-V3's node-limited top-k): ``topk`` experts out of the best
    ``group_topk`` of ``num_groups`` expert groups."""
    group_topk, groups = args.moe_router_group_topk, args.moe_router_num_groups
    if not group_topk:
        return
    if not groups:
        raise ConfigError("--moe-router-group-topk needs --moe-router-num-groups")
    if args.num_experts % groups:
        raise ConfigError(f"--num-experts {args.num_experts} is not divisible by --moe-router-num-groups {groups}")
    if group_topk > groups:
        raise ConfigError(f"--moe-router-group-topk {group_topk} must be <= --moe-router-num-groups {groups}")
    per_group = args.num_experts // groups
    if args.moe_router_topk > group_topk * per_group:
        # torch.topk inside megatron-core's group_limited_topk fails on the first forward
        raise ConfigError(
            f"--moe-router-topk {args.moe_router_topk} is more than the {group_topk * per_group} experts of "
            f"--moe-router-group-topk {group_topk} groups of {per_group}"
        )
