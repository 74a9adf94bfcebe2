"""The ``torch.cuda`` namespace answered by the accelerator.

megatron-core calls ``torch.cuda.current_device()`` (about 175 call sites),
``synchronize``, streams, events, memory statistics and the RNG directly. Each
of those names is pointed at the accelerator, so every call site, including a
user's GPU script, reaches ``torch.npu`` on the npu target and the host on cpu.
``torch.cuda.manual_seed`` matters most: left alone on a machine without CUDA
it is silently queued by ``torch.cuda._lazy_call`` and every TP rank's tracker
gets the same seed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "torch_cuda"


def _redirect(
    name: str,
    build: Callable[[Accelerator], Any],
    reason: str,
    requires: str = "patches_megatron_core",
    module: str = "torch.cuda",
) -> None:
    register(
        f"{module}.{name}",
        f"{module}:{name}",
        reason=reason,
        subsystem=SUBSYSTEM,
        requires=requires,
    )(lambda original, accelerator: build(accelerator))


def _method(method: str) -> Callable[[Accelerator], Any]:
    return lambda accelerator: getattr(accelerator, method)


_SAME_NAME = {
    "current_device": "the index megatron passes as device= is the accelerator's",
    "set_device": "binds the process to its local accelerator device",
    "device_count": "counts accelerator devices",
    "synchronize": "p2p_communication._communicate synchronises after batched p2p",
    "current_stream": "megatron's overlap paths ask for the current stream",
    "default_stream": "param_and_grad_buffer waits on the default stream",
    "stream": "context manager for a communication stream",
    "set_stream": "combined-1F1B schedule switches streams",
    "empty_cache": "DDP offload and checkpoint paths free cached memory",
    "memory_allocated": "memory reports",
    "max_memory_allocated": "memory reports",
    "memory_reserved": "memory reports",
    "max_memory_reserved": "memory reports",
    "memory_stats": "memory reports",
    "reset_peak_memory_stats": "memory reports",
    "get_rng_state": "CudaRNGStatesTracker.add saves the device RNG",
    "set_rng_state": "CheckpointFunction and the rerun machine restore the device RNG",
    "manual_seed": "model_parallel_cuda_manual_seed seeds each TP rank differently (silently lost otherwise)",
    "manual_seed_all": "seeding scripts",
}
for _name, _why in _SAME_NAME.items():
    _redirect(_name, _method(_name), _why)

_redirect("Stream", lambda accelerator: accelerator.Stream, "DDP and schedules create communication streams")
_redirect("Event", lambda accelerator: accelerator.Event, "timers and the straggler detector record events")
_redirect(
    "get_rng_state",
    _method("get_rng_state"),
    "_get_cuda_rng_state reads torch.cuda.random.get_rng_state",
    module="torch.cuda.random",
)
_redirect(
    "is_available",
    lambda accelerator: accelerator.is_available,
    "GPU scripts gate their device code on torch.cuda.is_available()",
    # Not on cpu: torch itself (inductor's torch.compile) reads it and would pick a CUDA backend on a
    # CPU build. megatron-core's unit suite answers True in its own harness (tests/conformance).
    requires="stands_in_for_cuda",
)
_redirect(
    "get_device_capability",
    lambda accelerator: lambda device=None: (0, 0),
    "off CUDA there is no CUDA compute capability: (0, 0), so no arch-gated path (Ampere bf16, Hopper fp8) is "
    "taken; megatron-core's tests read it at import where torch.cuda.is_available() answers True",
)
_redirect(
    "get_device_name",
    lambda accelerator: lambda device=None: accelerator.device_name(device),
    "logs and MFU tables name the device",
    requires="stands_in_for_cuda",
)


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


register(
    "torch.cuda.nvtx.range_push",
    "torch.cuda.nvtx:range_push",
    reason="nvtx ranges (profiling) do not exist off CUDA: no-op",
    subsystem=SUBSYSTEM,
)(lambda original, accelerator: _no_op)
register(
    "torch.cuda.nvtx.range_pop",
    "torch.cuda.nvtx:range_pop",
    reason="nvtx ranges (profiling) do not exist off CUDA: no-op",
    subsystem=SUBSYSTEM,
)(lambda original, accelerator: _no_op)
register(
    "torch.cuda.nvtx.range",
    "torch.cuda.nvtx:range",
    reason="nvtx ranges (profiling) do not exist off CUDA: no-op context",
    subsystem=SUBSYSTEM,
)(lambda original, accelerator: lambda *args, **kwargs: contextlib.nullcontext())


@register(
    "torch.accelerator.is_available.unredirected",
    "torch.accelerator:is_available",
    reason="torch's own code (the optimizers' graph-capture check, ...) asks torch.accelerator, which asks the "
    "build's device module: with a CUDA build of torch and no GPU, the redirected torch.cuda.is_available above "
    "would send it into CUDA's lazy init; it gets the device module's own answer",
    subsystem=SUBSYSTEM,
)
def _accelerator_is_available(original: Callable[[], bool], accelerator: Accelerator) -> Callable[[], bool]:
    import torch

    from megatron_npu.registry import REGISTRY

    def is_available() -> bool:
        device = torch.accelerator.current_accelerator()
        if device is None:  # a build without an accelerator
            return False
        return bool(REGISTRY.original_attribute(torch.get_device_module(device), "is_available")())

    return is_available
