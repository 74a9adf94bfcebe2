"""The FSDP section: Megatron-FSDP (``--use-megatron-fsdp``) or torch's FSDP2 (``--use-torch-fsdp2``) and
their options; ``training/fsdp_args.py`` holds Megatron-LM's rules for combining them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import Section, spec

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(frozen=True, kw_only=True)
class FsdpSection(Section):
    """Which FSDP and how it shards (Megatron-LM core_v0.16.1's FSDP flags of its distributed group)."""

    use_megatron_fsdp: bool = False
    """Use the Megatron FSDP code path in DDP."""

    data_parallel_sharding_strategy: Literal[SHARDING_STRATEGIES] = "no_shard"  # type: ignore[valid-type]
    """Sharding strategy of data parallelism."""

    gradient_reduce_div_fusion: bool = spec(True, "--no-gradient-reduce-div-fusion")
    """If not set, fuse the division in gradient reduce."""

    suggested_communication_unit_size: int | None = None
    """Elements communicated at once by FSDP (a larger value: larger buffers and all-gather prefetch)."""

    use_torch_fsdp2: bool = False
    """Use the torch FSDP2 implementation."""

    torch_fsdp2_reshard_after_forward: bool = spec(True, "--torch-fsdp2-no-reshard-after-forward")
    """Keep the gathered weights from forward to backward under FSDP2 (ZeRO-2)."""

    @property
    def enabled(self) -> bool:
        """Either FSDP implementation."""
        return self.use_megatron_fsdp or self.use_torch_fsdp2
