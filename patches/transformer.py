"""Transformer: a norm that supports sequence parallelism.

``WrappedTorchNorm`` refuses ``sequence_parallel``; it is replaced by
``SequenceParallelTorchNorm`` (same modules, weights marked for the TP gradient
all-reduce). The alias scan rebinds ``backends.LNImpl``/``WrappedTorchNorm``,
``transformer_block.LayerNormImpl`` and ``gpt_layer_specs.LNImpl`` as well.
"""

from __future__ import annotations

from typing import Any

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.ops.norm import SequenceParallelTorchNorm
from megatron_npu.registry import register

SUBSYSTEM = "transformer"


@register(
    "torch_norm.WrappedTorchNorm.sequence_parallel",
    "megatron.core.transformer.torch_norm:WrappedTorchNorm",
    reason="megatron's torch norm asserts not sequence_parallel; ours marks the weights for the TP grad all-reduce",
    subsystem=SUBSYSTEM,
)
def _norm(original: Any, accelerator: Accelerator) -> type:
    return SequenceParallelTorchNorm
