"""Transformer: a norm that supports sequence parallelism.

``WrappedTorchNorm`` refuses ``sequence_parallel``; it is replaced by
``SequenceParallelTorchNorm`` (same modules, weights marked for the TP gradient
all-reduce). The alias scan rebinds ``backends.LNImpl``/``WrappedTorchNorm``,
``transformer_block.LayerNormImpl`` and ``gpt_layer_specs.LNImpl`` as well.

And megatron-core's TorchScript fusions (bias-GeLU, bias-SwiGLU, bias-dropout-add) off in
every TransformerConfig where the accelerator says the jit fuser does not serve the device,
so any megatron-core script gets the unfused math instead of a fuser with no backend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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


@register(
    "transformer_config.TransformerConfig.__post_init__.jit_fusions",
    "megatron.core.transformer.transformer_config:TransformerConfig.__post_init__",
    reason="bias-GeLU/bias-SwiGLU/bias-dropout-add fusions are TorchScript: no device backend here (on cpu the "
    "first call compiles for ~30 s); the same math runs unfused (SwiGLU's device kernel is a spec'd module)",
    subsystem=SUBSYSTEM,
    requires="lacks_jit_fusion",
)
def _jit_fusions(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def __post_init__(self: Any) -> None:  # noqa: N807
        # Before megatron's own checks, which read them. The device's SwiGLU kernel is the
        # spec'd activation module (use_te_activation_func), not this jit path.
        self.bias_activation_fusion = False
        self.bias_dropout_fusion = False
        original(self)

    return __post_init__
