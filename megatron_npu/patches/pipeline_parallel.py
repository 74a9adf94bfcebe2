"""Pipeline p2p settings that megatron-core leaves to the trainer.

* Interleaved (virtual) pipeline with PP=2 and ``batch_p2p_comm=True`` (the
  ModelParallelConfig default) silently swaps activations and gradients: both
  ranks are each other's prev and next, and one batched call posts
  send_prev(grad) before send_next(act) to the same peer, so FIFO matching
  crosses them (NVIDIA/Megatron-LM#750, #1450). Megatron-LM's trainer asserts;
  megatron-core does not. The config is set to ``overlap_p2p_comm=True,
  batch_p2p_comm=False`` there, which is exact.
* Where the accelerator prefers separate isend/irecv (HCCL: MindSpeed sets
  ``batch_p2p_comm=False`` for PP>=2), batched p2p is turned off.
* ``deallocate_pipeline_outputs`` frees a stage's output right after its async
  send; that is safe only where sends are ordered on the device stream (NCCL,
  HCCL). Gloo reads the buffer later, so on such a backend it is turned off:
  otherwise the interleaved schedule sends freed memory (NaN gradients, at random).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "pipeline_parallel"


def needs_unbatched_p2p(config: Any, prefer_unbatched: bool) -> bool:
    """True when ``config``'s batched p2p must (or should) be turned off."""
    if not config.batch_p2p_comm or config.pipeline_model_parallel_size <= 1:
        return False
    vpp_swap = config.virtual_pipeline_model_parallel_size is not None and config.pipeline_model_parallel_size == 2
    return vpp_swap or prefer_unbatched


@register(
    "ModelParallelConfig.__post_init__.p2p",
    "megatron.core.model_parallel_config:ModelParallelConfig.__post_init__",
    reason="VPP with PP=2 and batched p2p swaps activations and gradients; on npu batched p2p is slower; "
    "gloo sends read pipeline outputs after megatron frees them",
    subsystem=SUBSYSTEM,
)
def _post_init(original: Callable, accelerator: Accelerator) -> Callable:
    prefer_unbatched = accelerator.prefers_unbatched_p2p
    may_free_sent_outputs = accelerator.stream_ordered_p2p

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:  # noqa: N807
        if not may_free_sent_outputs:
            self.deallocate_pipeline_outputs = False
        if needs_unbatched_p2p(self, prefer_unbatched):
            if self.virtual_pipeline_model_parallel_size is not None:
                warnings.warn(
                    "interleaved pipeline with pipeline_model_parallel_size=2 needs "
                    "overlap_p2p_comm=True, batch_p2p_comm=False (batched p2p swaps activations "
                    "and gradients); megatron-npu set them",
                    stacklevel=3,
                )
                self.overlap_p2p_comm = True
            self.batch_p2p_comm = False
        original(self)

    return __post_init__
