"""Tensor-parallel mappings: the all-reduce region's output made a tensor of its own.

megatron-core's ``_ReduceFromModelParallelRegion.forward`` returns its input object (``_reduce``: as is for a
group of one, all-reduced in place otherwise), which autograd records as a view created in a custom Function,
and any in-place update of it raises. ``MLP.forward`` does exactly that for an expert with biases
(``output += output_bias * per_token_scale``, megatron-core 0.15-0.19): a SequentialMLP expert of a model with
``--add-bias-linear`` (gpt-oss) whose fc2 reduces over its TP group (expert TP 1 without EP: explicit expert
communication is off) fails in its first forward, "Output 0 of _ReduceFromModelParallelRegion is a view and is
being modified inplace". A megatron-core defect with the local spec on every device (Transformer Engine's
linear returns a new tensor). The output becomes a detached alias of the same storage: no copy, the same
gradient (the backward passes grad_output through), and it shares the input's version counter, so an in-place
update that a saved tensor would see is still refused by autograd.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "mappings"


@register(
    "_ReduceFromModelParallelRegion.forward.own_output",
    "megatron.core.tensor_parallel.mappings:_ReduceFromModelParallelRegion.forward",
    reason="returns its input object, which autograd takes for a view made in a custom Function: MLP.forward's "
    "in-place expert bias (output += output_bias * per_token_scale) raises in a SequentialMLP with biases "
    "(gpt-oss, local spec, expert TP 1 without EP); the output is a detached alias of the same storage",
    subsystem=SUBSYSTEM,
    # the same _reduce in 0.12.1 ... 0.19.2; forward(ctx, input_) in 0.12, (ctx, input_, group) from 0.13
    megatron_versions=">=0.12.0,<0.20",
)
def _reduce_forward(original: Callable[..., torch.Tensor], accelerator: Accelerator) -> Callable[..., torch.Tensor]:
    def forward(ctx: Any, input_: torch.Tensor, *group: Any) -> torch.Tensor:
        output = original(ctx, input_, *group)
        return output.detach() if output is input_ else output

    return forward
