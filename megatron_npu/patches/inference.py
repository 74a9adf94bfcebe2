"""megatron-core's inference pipeline communication checks its tensors are device tensors by ``tensor.is_cuda``.

``megatron.core.inference.communication_utils`` asserts ``_is_cuda(tensor)`` before every broadcast from the last
pipeline stage and every p2p send/receive of the static and dynamic engines; ``is_cuda`` is False for an npu tensor
(and on the cpu target, whose device is the host, for every tensor), so the last stage failed the assertion while
the other stages waited in the broadcast for it: a hang (megatron-core's own inference/test_communication_utils.py,
test_broadcast_comparison, 300 s per case in the conformance run). Replaced: ``_is_cuda``, asking the accelerator
whether the tensor is a device tensor (``_is_cuda_contiguous`` calls it by name). 0.12-0.19 have the same check.
"""

from __future__ import annotations

import functools
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
