"""Megatron-LM core_v0.16.1's Mixture-of-Experts flags (its ``_add_moe_args`` plus the MoE fields
it generates from megatron-core's TransformerConfig), with the same spellings, dests and defaults.

Megatron-LM builds most of these from ``TransformerConfig``'s dataclass fields; this module is
pure Python (the migration tool imports the parser), so the defaults are written out and
``tests/test_moe.py`` checks them against megatron-core's dataclass. Flags of the family this
trainer cannot run (DeepEP/HybridEP, upcycling, TE's fused permutation, ...) are not defined
here: ``policy.py``'s ``--moe-*`` row refuses them by name.
"""

from __future__ import annotations

import argparse

from ..layout.moe import moe_freq_type


def add_moe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(title="moe")
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="Expert FFN size; --ffn-hidden-size if unset.")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-gate", action="store_true", default=False)
    g.add_argument(
        "--moe-router-load-balancing-type",
        nargs="+",
        type=str,
        choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
        default="aux_loss",
    )
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-input-jitter-eps", type=float, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-pre-softmax", action="store_true", default=False)
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-num-groups", type=int, default=None)
    g.add_argument("--moe-router-group-topk", type=int, default=None)
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true", default=False)
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-grouped-gemm", action="store_true", default=False)
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default="allgather")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true", default=False)
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default="probs")
    g.add_argument("--moe-per-layer-logging", action="store_true", default=False)
    g.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="Expert TP; --tensor-model-parallel-size if unset.",
    )
