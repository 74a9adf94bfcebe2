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
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

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


def _apply_collective_timeout(accelerator: Accelerator, timeout: timedelta) -> None:
    """The process group's timeout (``--distributed-timeout-minutes``) also bounds what the
    collective library waits on its own (HCCL's execution and link set-up timeouts): a dead
    peer then stops every rank within the timeout the user asked for, never later."""
    environment = accelerator.collective_timeout_environment(timeout, os.environ)
    for name, value in environment.items():
        _log.info("%s=%s from the process group timeout (%s)", name, value, timeout)
    os.environ.update(environment)


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
        timeout = args[1] if len(args) > 1 else kwargs.get("timeout")  # (init_method, timeout, ...)
        if timeout is not None:
            _apply_collective_timeout(accelerator, timeout)
        return wrapped(*args, **kwargs)

    return init_process_group


for _module in ("torch.distributed", "torch.distributed.distributed_c10d"):
    register(
        f"{_module}.init_process_group.backend",
        f"{_module}:init_process_group",
        reason=(
            "init_process_group('nccl') and the default backend become the accelerator's; its timeout"
            " also sets the collective library's own timeouts where the accelerator names them"
        ),
        subsystem=SUBSYSTEM,
    )(_positional_backend)
    register(
        f"{_module}.new_group.backend",
        f"{_module}:new_group",
        reason="new_group(backend='nccl') becomes the accelerator's backend; gloo stays gloo",
        subsystem=SUBSYSTEM,
    )(_group_wrapper)


# ----- float64 all-reduce where the collective library has none --------------------------
class _CompletedWork:
    """What ``all_reduce(async_op=True)`` returns when the reduction already happened."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _reduce_gathered(values: torch.Tensor, op: Any) -> torch.Tensor | None:
    """``values`` (one row per rank) reduced by ``op``; None for an op not handled here."""
    reduce_op = torch.distributed.ReduceOp
    reductions = {
        reduce_op.SUM: lambda: values.sum(0),
        reduce_op.AVG: lambda: values.mean(0),
        reduce_op.MIN: lambda: values.amin(0),
        reduce_op.MAX: lambda: values.amax(0),
        reduce_op.PRODUCT: lambda: values.prod(0),
    }
    for candidate, reduce in reductions.items():
        if op == candidate:
            return reduce()
    return None


def exact_float64_all_reduce(original: Callable, accelerator: Accelerator) -> Callable:
    """all_reduce that never hands a float64 tensor to the collective library.

    Each rank's values travel as their raw bytes (an int32 view, which every library
    gathers), and every rank reduces the gathered rows in float64 in rank order: exact,
    and the result is written back into the caller's tensor (an adaptor that reduced a
    float32 copy and forgot the copy-back has been seen: ascend-facts.md). Costs a gather
    of world_size copies, fine for the scalars Megatron-LM reduces in float64.
    """

    @functools.wraps(original)
    def all_reduce(
        tensor: torch.Tensor, op: Any = torch.distributed.ReduceOp.SUM, group: Any = None, async_op: bool = False
    ) -> Any:
        if tensor.dtype != torch.float64:
            return original(tensor, op=op, group=group, async_op=async_op)
        words = tensor.detach().reshape(-1).contiguous().view(torch.int32)
        gathered = [torch.empty_like(words) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(gathered, words, group=group)
        rows = torch.stack([row.view(torch.float64) for row in gathered])
        reduced = _reduce_gathered(rows, op)
        if reduced is None:  # an op this wrapper does not know: let the library answer
            return original(tensor, op=op, group=group, async_op=async_op)
        with torch.no_grad():
            tensor.copy_(reduced.view(tensor.shape))
        return _CompletedWork() if async_op else None

    return all_reduce


for _module in ("torch.distributed", "torch.distributed.distributed_c10d"):
    register(
        f"{_module}.all_reduce.float64",
        f"{_module}:all_reduce",
        reason="the collective library has no float64 all-reduce; Megatron-LM reduces its start-up "
        "timestamps in float64 (training.py, core_v0.16.1): reduced exactly from gathered bytes",
        subsystem=SUBSYSTEM,
        requires="lacks_float64_reduction",
    )(exact_float64_all_reduce)
