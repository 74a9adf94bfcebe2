"""A torch norm that supports sequence parallelism and zero-centered weights.

megatron-core's ``WrappedTorchNorm`` (the norm used without apex/TE) asserts
``not config.sequence_parallel`` and ``not config.layernorm_zero_centered_gamma``. With sequence
parallelism the norm weights see a slice of the sequence on each TP rank, so their gradients must be
summed over TP; ``finalize_model_grads`` does that for every parameter carrying
``sequence_parallel=True``, the same contract as apex's FusedLayerNorm. Zero-centered weights
(Megatron-LM's ``--apply-layernorm-1p``, Transformer Engine's ``zero_centered_gamma``) are stored as
gamma - 1, initialised to 0 and applied as 1 + weight, as TE's norms do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from megatron_npu.ops.fused import RMSNorm, rms_norm


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """LayerNorm whose weight is gamma - 1 (zero at initialisation), applied as 1 + weight."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm (the device's fused kernel where there is one) whose weight is gamma - 1, applied as 1 + weight."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight + 1, self.eps if self.eps is not None else torch.finfo(x.dtype).eps)


NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": RMSNorm}
ZERO_CENTERED_NORMS = {"LayerNorm": ZeroCenteredLayerNorm, "RMSNorm": ZeroCenteredRMSNorm}


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
        kind = getattr(config, "normalization", normalization)
        if kind not in NORMS:
            raise ValueError(f"normalization {kind!r} is not supported; choose one of {', '.join(NORMS)}")
        centered = zero_centered_gamma or getattr(config, "layernorm_zero_centered_gamma", False)
        norm = (ZERO_CENTERED_NORMS if centered else NORMS)[kind](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        return norm
