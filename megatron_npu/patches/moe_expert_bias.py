"""Experts' fc2 bias: not marked sequence-parallel, so its gradient is summed over TP only where it must be.

megatron-core's ``RowParallelLinear.__init__`` marks its bias ``sequence_parallel = config.sequence_parallel``
for every instance, experts included (``is_expert=True``: the fc2 of each SequentialMLP expert, which is where
``--add-bias-linear`` experts keep their output bias, gpt-oss). ``finalize_model_grads`` then all-reduces every
parameter so marked over the tensor-parallel group, the sum a dense layer's bias needs because its output is split
over the sequence there. An expert's is not: its tokens come from the dispatcher, its gradient is reduced like every
other expert parameter over the expert-data-parallel group (which, at expert TP 1, already spans the TP ranks), so
under TP x SP the bias gradient was summed over TP a second time (or, where EP spans the TP ranks, added to another
expert's): lm loss off by rel 2.6e-4 one step after a resume at TP2 x EP2 x SP against the 1-rank run. Transformer
Engine's linear layers never mark an expert's parameters so; the local spec's are made to agree, in both trainers
(they build experts through this class; Megatron-LM's through ``-m megatron_npu.run``). A megatron-core
defect on every device, with the local spec. No upstream issue names it (searched; the nearest, NVIDIA/Megatron-LM
PRs #5916 and #6099, fix expert parameters counted over the wrong TP group in the gradient norm, biased experts at
ETP 1 included, not this sum). The marking and the sum are the same from 0.12.1 to 0.19.2 (RowParallelLinear.__init__,
finalize_model_grads' _allreduce_non_tensor_model_parallel_grads / _allreduce_layernorm_grads).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "moe_expert_bias"


@register(
    "RowParallelLinear.__init__.expert_bias_not_sequence_parallel",
    "megatron.core.tensor_parallel.layers:RowParallelLinear.__init__",
    reason="marks an expert's fc2 bias sequence_parallel, so finalize_model_grads sums its gradient over TP on top "
    "of the expert-data-parallel reduction (biased experts under TP x SP, gpt-oss: rel 2.6e-4 off the 1-rank run); "
    "an expert's bias is left unmarked, as Transformer Engine's expert layers leave it",
    subsystem=SUBSYSTEM,
    # setattr(self.bias, "sequence_parallel", self.sequence_parallel) for is_expert alike in 0.12.1 ... 0.19.2
    megatron_versions=">=0.12.0,<0.20",
)
def _row_parallel_init(original: Callable[..., None], accelerator: Accelerator) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        original(self, *args, **kwargs)
        if self.is_expert and self.bias is not None:
            self.bias.sequence_parallel = False

    return __init__
