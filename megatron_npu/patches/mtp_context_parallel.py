"""Multi-token prediction under context parallelism: the MTP loss normalized by the CP group's token count.

megatron-core's ``roll_tensor`` shifts the MTP labels and loss mask one token left and returns the rolled tensor
with its sum, the number of loss tokens the MTP loss is divided by (``GPTModel._postprocess`` in 0.14-0.16,
``process_mtp_loss`` from 0.17). Under ``--context-parallel-size`` > 1 that sum is this CP rank's alone, and the
sequence's last token, which the roll drops, lives on one rank: that rank divides by one token fewer than the
others, so neither the MTP loss logged (a mean of the ranks' means) nor its gradient is the one-rank run's
(rel 3.5e-5 on the DeepSeek-V3-style model at CP2). NVIDIA/Megatron-LM PR #7498 (open) counts the tokens over
the CP group. Here the count becomes the CP group's total divided by the CP size: every rank then divides its
partial sum by the same share of the whole, so the ranks' average (the tracker's over the DP x CP group, and the
gradient's, which DDP averages over DP x CP) is the whole sequence's sum over its token count, as on one rank.
The per-token-loss path of 0.17+ (``original_num_tokens / num_tokens``) gets the one-rank ratio the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "mtp_context_parallel"

RollTensor = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def cp_share_of_count(count: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """The CP group's total of ``count`` divided by the group's size (``count`` itself outside CP)."""
    if cp_group is None or cp_group.size() == 1:
        return count
    total = count.detach().clone()
    torch.distributed.all_reduce(total, group=cp_group)
    return total / cp_group.size()


@register(
    "roll_tensor.cp_token_count",
    "megatron.core.transformer.multi_token_prediction:roll_tensor",
    reason="returns this CP rank's token count, by which the MTP loss and its gradient are averaged: under CP the "
    "rank holding the sequence's last token (dropped by the roll) counts one fewer, so the MTP loss is not the "
    "one-rank run's (rel 3.5e-5 at CP2); the count becomes the CP group's total over the CP size "
    "(NVIDIA/Megatron-LM PR #7498, open)",
    subsystem=SUBSYSTEM,
    # roll_tensor takes cp_group from 0.14 (0.12 / 0.13 roll without CP), and its count
    # is the MTP loss's divisor in 0.14.0 ... 0.19.2 (gpt_model.py to 0.16, process_mtp_loss from 0.17)
    megatron_versions=">=0.14.0,<0.20",
)
def _roll_tensor(original: RollTensor, accelerator: Accelerator) -> RollTensor:
    def roll_tensor(
        tensor: torch.Tensor, shifts: int = -1, dims: int = -1, cp_group: Any = None, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rolled, count = original(tensor, shifts=shifts, dims=dims, cp_group=cp_group, **kwargs)
        return rolled, cp_share_of_count(count, cp_group)

    return roll_tensor
