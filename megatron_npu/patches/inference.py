"""megatron-core's inference off CUDA: its pipeline communication's device check, and its flash-attn version check.


``megatron.core.inference.communication_utils`` asserts ``_is_cuda(tensor)`` before every broadcast from the last
pipeline stage and every p2p send/receive of the static and dynamic engines; ``is_cuda`` is False for an npu tensor
(and on the cpu target, whose device is the host, for every tensor), so the last stage failed the assertion while
the other stages waited in the broadcast for it: a hang (megatron-core's own inference/test_communication_utils.py,
test_broadcast_comparison, 300 s per case in the conformance run). Replaced: ``_is_cuda``, asking the accelerator
whether the tensor is a device tensor (``_is_cuda_contiguous`` calls it by name). 0.12-0.19 have the same check.

``megatron.core.utils.is_fa_min_version`` imports ``flash_attn`` to read its version and raises
``ModuleNotFoundError`` where it is absent (always on npu and cpu: FlashAttention is CUDA kernels). The static
engine's tests evaluate it in a class-level ``skipif`` (inference/engines/test_static_engine.py: the whole file
failed to import, hiding its local-spec tests), and attention.py's flash-decode check calls it. Without flash_attn
no minimum flash_attn version is met: False, as the patch layer answers ``is_te_min_version`` without TE.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "inference"


@register(
    "inference.communication_utils.is_device_tensor",
    "megatron.core.inference.communication_utils:_is_cuda",
    reason="asserts tensor.is_cuda, False for npu (and cpu-target) tensors: the last pipeline stage failed before "
    "the broadcast its peers wait in (a hang); the accelerator says whether the tensor is a device tensor",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.12.0,<0.20",
)
def _is_device_tensor(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def _is_cuda(tensor: Any) -> None:
        assert tensor is not None
        assert accelerator.is_device_tensor(tensor), f"a {tensor.device} tensor, not on the accelerator's device"

    return _is_cuda


@register(
    "utils.is_fa_min_version.without_flash_attn",
    "megatron.core.utils:is_fa_min_version",
    reason="imports flash_attn to compare its version: ModuleNotFoundError without it (always off CUDA), at the "
    "import of inference/engines/test_static_engine.py (a class-level skipif); without flash_attn no minimum "
    "version is met: False",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.12.0,<0.20",
)
def _is_fa_min_version(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def is_fa_min_version(version: str, check_equality: bool = True) -> bool:
        if importlib.util.find_spec("flash_attn") is None:
            return False
        return original(version, check_equality)

    return is_fa_min_version
