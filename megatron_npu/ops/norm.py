"""A torch norm that supports sequence parallelism.

megatron-core's ``WrappedTorchNorm`` (the norm used without apex/TE) asserts
``not config.sequence_parallel``. With sequence parallelism the norm weights see a
slice of the sequence on each TP rank, so their gradients must be summed over TP;
``finalize_model_grads`` does that for every parameter carrying
``sequence_parallel=True``, the same contract as apex's FusedLayerNorm.
"""

from __future__ import annotations

import torch

from megatron_npu.ops.fused import RMSNorm

NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": RMSNorm}


class SequenceParallelTorchNorm:
    """Builds ``torch.nn.LayerNorm`` / ``RMSNorm`` (fused where the device has it) from a TransformerConfig."""

    def __new__(
        cls,
        config: object,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError("zero-centered gamma needs Transformer Engine; unset --apply-layernorm-1p")
        kind = getattr(config, "normalization", normalization)
        if kind not in NORMS:
            raise ValueError(f"normalization {kind!r} is not supported; choose one of {', '.join(NORMS)}")
        norm = NORMS[kind](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        return norm
