"""Process groups: backend "nccl" becomes the accelerator's backend everywhere.

``transfer_to_npu`` maps the backend in ``init_process_group`` only; megatron-core
and user code also pass backends to ``new_group``. Both are wrapped here, so
``backend="nccl"`` gives hccl on npu and gloo on cpu, while groups megatron makes
gloo on purpose (``backend="gloo"``) stay gloo. NCCL-only ``pg_options`` are dropped
when the backend changes, and ``device_id=torch.device("cuda", i)`` is mapped.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

from .device_arguments import FOREIGN_DEVICE_TYPE, device_mapper

SUBSYSTEM = "distributed"
FOREIGN_BACKEND = "nccl"
_log = logging.getLogger(__name__)


def backend_mapper(accelerator: Accelerator) -> Callable[[Any], Any]:
    """Map a backend spec ("nccl", "cpu:gloo,cuda:nccl", None) to the target's."""
    native = accelerator.communication_backend
    device_type = accelerator.device_type

    def map_backend(backend: Any) -> Any:
        if not isinstance(backend, str):
            return backend
        lowered = backend.lower()
        if lowered == FOREIGN_BACKEND:
            return native
        if ":" in lowered:  # per-device form: "cpu:gloo,cuda:nccl"
            parts = []
            for item in lowered.split(","):
                device, _, name = item.partition(":")
                if device == FOREIGN_DEVICE_TYPE:
                    device = device_type
                if name == FOREIGN_BACKEND:
                    name = native
                parts.append(f"{device}:{name}")
            merged = dict(part.split(":") for part in parts)  # cpu:gloo twice collapses
            return ",".join(f"{device}:{name}" for device, name in merged.items())
        return backend

    return map_backend


def _group_wrapper(original: Callable, accelerator: Accelerator) -> Callable:
    map_backend = backend_mapper(accelerator)
    map_device = device_mapper(accelerator)

    @functools.wraps(original)
    def create(*args: Any, **kwargs: Any) -> Any:
        requested = kwargs.get("backend")
        if requested is not None:
            mapped = map_backend(requested)
            if mapped != requested:
                kwargs["backend"] = mapped
                if kwargs.get("pg_options") is not None:
                    _log.warning("dropping %s pg_options for backend %s", requested, mapped)
                    kwargs["pg_options"] = None
        device_id = kwargs.get("device_id")
        if device_id is not None:
            # gloo binds no device: a host device_id would be rejected.
            kwargs["device_id"] = map_device(device_id) if accelerator.collectives_bind_device else None
        return original(*args, **kwargs)

    return create


def _positional_backend(original: Callable, accelerator: Accelerator) -> Callable:
    """init_process_group takes the backend as its first positional argument."""
    wrapped = _group_wrapper(original, accelerator)
    map_backend = backend_mapper(accelerator)

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if args:
            kwargs.setdefault("backend", args[0])
            args = args[1:]
        if kwargs.get("backend") is None:
            kwargs["backend"] = accelerator.communication_backend
        kwargs["backend"] = map_backend(kwargs["backend"])
        return wrapped(*args, **kwargs)

    return init_process_group


for _module in ("torch.distributed", "torch.distributed.distributed_c10d"):
    register(
        f"{_module}.init_process_group.backend",
        f"{_module}:init_process_group",
        reason="init_process_group('nccl') and the default backend become the accelerator's",
        subsystem=SUBSYSTEM,
    )(_positional_backend)
    register(
        f"{_module}.new_group.backend",
        f"{_module}:new_group",
        reason="new_group(backend='nccl') becomes the accelerator's backend; gloo stays gloo",
        subsystem=SUBSYSTEM,
    )(_group_wrapper)
