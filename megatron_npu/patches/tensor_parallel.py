"""megatron-core's RNG tracker on the accelerator's generator.

``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` bypass the public torch.cuda API:
the setter goes through ``torch.cuda._lazy_call`` and ``default_generators``. Off
CUDA the queued call never runs, so ``CudaRNGStatesTracker.fork()`` silently does
not switch streams and every TP rank draws the same dropout masks. Both helpers
are replaced by the accelerator's get/set, which take effect immediately.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "tensor_parallel"
RANDOM = "megatron.core.tensor_parallel.random"
HOST_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


@register(
    "tensor_parallel.random._get_cuda_rng_state",
    f"{RANDOM}:_get_cuda_rng_state",
    reason="read the accelerator's RNG state (the cudagraph-safe variant is CUDA-only)",
    subsystem=SUBSYSTEM,
)
def _get_rng_state(original: Callable, accelerator: Accelerator) -> Callable:
    def _get_cuda_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        if graph_safe:
            raise NotImplementedError("cudagraph-safe RNG needs CUDA graphs; unset use_cudagraphable_rng")
        state = accelerator.get_rng_state()
        return state.clone() if clone else state

    return _get_cuda_rng_state


@register(
    "tensor_parallel.random._set_cuda_rng_state",
    f"{RANDOM}:_set_cuda_rng_state",
    reason="set the accelerator's RNG state now, not through torch.cuda._lazy_call (a silent no-op off CUDA)",
    subsystem=SUBSYSTEM,
)
def _set_rng_state(original: Callable, accelerator: Accelerator) -> Callable:
    def _set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        if graph_safe:
            raise NotImplementedError("cudagraph-safe RNG needs CUDA graphs; unset use_cudagraphable_rng")
        accelerator.set_rng_state(new_state)

    return _set_cuda_rng_state


class _DropHostRngWarning(logging.Filter):
    """On the cpu target the device RNG *is* the host RNG: the warning is expected."""

    def filter(self, record: logging.LogRecord) -> bool:
        return HOST_RNG_WARNING not in record.getMessage()


@register(
    "tensor_parallel.random.CudaRNGStatesTracker.fork",
    f"{RANDOM}:CudaRNGStatesTracker.fork",
    reason="on cpu the device RNG is the host RNG, so fork()'s 'CPU RNG state changed' warning fires on every call",
    subsystem=SUBSYSTEM,
    requires="device_rng_is_host_rng",
)
def _quiet_fork(original: Callable, accelerator: Accelerator) -> Callable:
    logger = logging.getLogger(RANDOM)
    if not any(isinstance(existing, _DropHostRngWarning) for existing in logger.filters):
        logger.addFilter(_DropHostRngWarning())
    return original
