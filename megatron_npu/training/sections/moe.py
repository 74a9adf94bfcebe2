"""The Mixture-of-Experts section: Megatron-LM core_v0.16.1's MoE flags (its ``_add_moe_args`` and the MoE
fields it generates from megatron-core's TransformerConfig), same spellings, dests and defaults.

Pure Python, so the defaults are written out; ``tests/training/test_moe.py`` checks them against
megatron-core's dataclass. The family's flags this trainer cannot run (DeepEP / HybridEP, upcycling,
TE's fused permutation, ...) are not fields: ``policy.py``'s ``--moe-*`` row refuses them by name.
``training/moe_args.py`` holds the rules megatron-core would assert later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...fates import DEEPEP, FlagPolicy
from ...layout.moe import moe_freq_type
from .base import Section, spec

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


@dataclass(frozen=True, kw_only=True)
class MoeSection(Section):
    """The experts, the router and the token dispatcher (megatron-core's TransformerConfig MoE fields)."""

    num_experts: int | None = None
    """Number of experts in MoE (none: no MoE)."""

    moe_layer_freq: int | tuple[int, ...] = spec(1, type=moe_freq_type, nargs=None)
    """MoE layers among the dense ones: N, one expert layer for every N-1 dense layers; or a Python list
    expression, 1 an expert layer and 0 a dense one, e.g. "([0]+[1]*23)"."""

    moe_ffn_hidden_size: int | None = None
    """Expert FFN size; --ffn-hidden-size if unset."""

    moe_shared_expert_intermediate_size: int | None = None
    """Shared experts' total FFN hidden size (shared experts x each one's FFN size); none: no shared expert."""

    moe_shared_expert_gate: bool = False
    """Enable gate for shared expert (with --moe-shared-expert-intermediate-size)."""

    moe_router_load_balancing_type: str | tuple[str, ...] = spec(
        "aux_loss", type=str, nargs="+", choices=list(LOAD_BALANCING_TYPES)
    )
    """The router's load balancing: aux_loss (GShard / Switch Transformer), seq_aux_loss (per sample, DeepSeek-V2),
    global_aux_loss, sinkhorn (S-BASE) or none; several types take one --moe-aux-loss-coeff each."""

    moe_aux_loss_coeff: float | tuple[float, ...] = spec(0.0, type=float, nargs="+")
    """Scaling coefficient for the aux loss (one per load-balancing type): a starting value of 1e-2 is
    recommended."""

    moe_z_loss_coeff: float | None = None
    """Scaling coefficient for the z-loss. A starting value of 1e-3 is recommended."""

    moe_input_jitter_eps: float | None = None
    """Add noise to the input tensor by applying jitter with a specified epsilon value."""

    moe_router_topk: int = 2
    """Number of experts to route to for each token."""

    moe_router_pre_softmax: bool = False
    """Softmax (or sigmoid) before the top-k selection instead of after it."""

    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Score function for MoE routing."""

    moe_router_topk_scaling_factor: float | None = None
    """Scaling factor of the routing scores in top-k selection (with --moe-router-pre-softmax); none: no
    scaling."""

    moe_router_num_groups: int | None = None
    """Groups the experts are divided into for group-limited routing (device- or node-limited routing, as
    DeepSeek-V2 / V3)."""

    moe_router_group_topk: int | None = None
    """Number of selected groups for group-limited routing."""

    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    """Data type of routing and of the expert outputs' weighted average; none: the model's."""

    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free load balancing: top-k routing on the scores plus a per-expert bias updated each step."""

    moe_router_bias_update_rate: float = 1e-3
    """How fast the expert bias follows each expert's share of the global batch's tokens (DeepSeek-V3's 1e-3)."""

    moe_grouped_gemm: bool = False
    """One grouped GEMM for the local experts instead of one GEMM each."""

    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = spec(
        "allgather",
        fates=(
            FlagPolicy(
                "--moe-token-dispatcher-type",
                "refused",
                DEEPEP,
                "use --moe-token-dispatcher-type alltoall (or allgather)",
                allowed=("allgather", "alltoall"),
                scope="device",
            ),
        ),
    )
    """The type of token dispatcher to use."""

    moe_expert_capacity_factor: float | None = None
    """The capacity factor of each expert; none: no token is dropped."""

    moe_pad_expert_input_to_capacity: bool = False
    """Pad each expert's input to its capacity (with --moe-expert-capacity-factor)."""

    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    """Which tokens are dropped: the lowest-probability ones (probs) or the last in each batch (position)."""

    moe_per_layer_logging: bool = False
    """Enable per-layer logging for MoE, currently supports auxiliary loss and z loss."""
