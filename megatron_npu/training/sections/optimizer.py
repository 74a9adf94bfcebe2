"""The optimizer section: which optimizer, its hyper-parameters, gradient clipping and loss scaling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import Section


@dataclass(frozen=True, kw_only=True)
class OptimizerSection(Section):
    """The optimizer, its hyper-parameters, gradient clipping and loss scaling (megatron-core's OptimizerConfig fields of the same names)."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer function"""

    weight_decay: float = 0.01
    """Weight decay coefficient."""

    clip_grad: float = 1.0
    """Gradient clipping on global L2 norm."""

    adam_beta1: float = 0.9
    """First coefficient for computing running averages of gradient and its square"""

    adam_beta2: float = 0.999
    """Second coefficient for computing running averages of gradient and its square"""

    adam_eps: float = 1e-08
    """Term added to the denominator to improvenumerical stability"""

    sgd_momentum: float = 0.9
    """Momentum factor for sgd."""

    loss_scale: float | None = None
    """Static loss scale; dynamic if not given."""

    initial_loss_scale: float = 4294967296
    """Initial loss-scale for dynamic loss scaling."""

    min_loss_scale: float = 1.0
    """Minimum loss scale for dynamic loss scaling."""

    loss_scale_window: float = 1000
    """Window over which to raise/lower dynamic scale."""

    hysteresis: int = 2
    """hysteresis for dynamic loss scaling"""
