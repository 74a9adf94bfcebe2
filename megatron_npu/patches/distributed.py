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
    # The accelerator's group-creation variables (gloo: lazy connect), read by every group created
    # from here on. Set when the patch applies, not per call: megatron-core's test conftest restores
    # os.environ after each test, which dropped a variable set inside the first test's init call.
    for name, value in accelerator.process_group_environment().items():
        os.environ.setdefault(name, value)
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
            " also sets the collective library's own timeouts where the accelerator names them, and the"
            " accelerator's group-creation variables (gloo: lazy connect) are set for every later group"
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


# ----- groups megatron-core releases, and gathers gloo checks by shape ---------------------
PARALLEL_STATE = "megatron.core.parallel_state"


def groups_megatron_created() -> list[Any]:
    """The groups this rank belongs to that parallel_state.create_group made (its own list)."""
    parallel_state = __import__(PARALLEL_STATE, fromlist=["_global_process_group_list"])
    return [group for group in parallel_state._global_process_group_list or () if group is not None]


RELEASE_TIMEOUT = timedelta(seconds=60)
_released_before: dict[str, int] = {}


def _release_keys(group: Any) -> tuple[str, str]:
    """Store keys counting the members that released ``group`` (its n-th release under this name)."""
    name = group.group_name
    _released_before[name] = generation = _released_before.get(name, 0) + 1
    key = f"megatron_npu/released/{name}/{generation}"
    return key, key + "/all"


def destroy_when_released(groups: list[Any]) -> int:
    """Destroy ``groups`` once every member has released them.

    A gloo group that connects lazily may still be connecting on one member while another, done
    with it, would close its side: "Connection closed by peer" (transformer/moe/test_aux_loss.py).
    Each member counts itself in on the default store (no group connection needed) and waits for
    the others; a group some member never releases within RELEASE_TIMEOUT is left in place.
    """
    c10d = torch.distributed.distributed_c10d
    if not torch.distributed.is_initialized():
        return 0
    default = c10d._get_default_group()
    store = c10d._get_default_store()
    live = [group for group in groups if group is not default and group in c10d._world.pg_map]
    waits = []
    for group in live:
        key, everyone = _release_keys(group)
        if store.add(key, 1) == group.size():
            store.set(everyone, b"1")
        waits.append((group, everyone))
    destroyed = 0
    for group, everyone in waits:
        try:
            store.wait([everyone], RELEASE_TIMEOUT)
        except RuntimeError:  # a member kept it (timeout): leaking one group beats closing it under a peer
            _log.warning("process group %s: not released by all its members; left in place", group.group_name)
            continue
        torch.distributed.destroy_process_group(group)
        destroyed += 1
    return destroyed


@register(
    "parallel_state.destroy_model_parallel.destroy_groups",
    f"{PARALLEL_STATE}:destroy_model_parallel",
    reason="drops its references to the groups create_group made but destroys only the gloo DP ones; a gloo "
    "group keeps its threads (one polling every 10 ms), so a job that re-initialises model parallelism (megatron-"
    "core's unit tests, per test) piles up ~470 threads per rank and starves (dist_checkpointing/"
    "test_serialization.py); the released groups are destroyed once all their members released them",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.16.0,<0.17",
    requires="groups_hold_threads",
)
def _destroy_released_groups(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def destroy_model_parallel(*args: Any, **kwargs: Any) -> Any:
        released = groups_megatron_created()
        result = original(*args, **kwargs)
        destroy_when_released(released)
        return result

    return destroy_model_parallel


def flat_all_gather(original: Callable, accelerator: Accelerator) -> Callable:
    """all_gather_into_tensor by element count, as NCCL and HCCL check it.

    megatron-core gathers shaped inputs into flat outputs (gather_split_1d_tensor: a (2, 4)
    input into a 16-element output); gloo checks each output chunk's shape against the input's.
    Where the counts agree and the shapes do not, both travel as flat views of the same memory.
    """

    @functools.wraps(original)
    def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, *args: Any, **kwargs: Any):
        if (
            output_tensor.dim() != input_tensor.dim()
            and output_tensor.is_contiguous()
            and input_tensor.is_contiguous()
            and output_tensor.numel() % max(input_tensor.numel(), 1) == 0
        ):
            return original(output_tensor.view(-1), input_tensor.view(-1), *args, **kwargs)
        return original(output_tensor, input_tensor, *args, **kwargs)

    return all_gather_into_tensor


for _module in ("torch.distributed", "torch.distributed.distributed_c10d"):
    register(
        f"{_module}.all_gather_into_tensor.flat",
        f"{_module}:all_gather_into_tensor",
        reason="megatron-core gathers a shaped tensor into a flat one (gather_split_1d_tensor); NCCL checks element "
        "counts, gloo shapes: 'invalid tensor size' (tensor_parallel/test_tensor_parallel_utils.py::"
        "test_gather_split_1d_tensor); flat views of the same memory are gathered",
        subsystem=SUBSYSTEM,
        requires="lacks_flat_all_gather",
    )(flat_all_gather)


def uneven_all_gather(original: Callable, accelerator: Accelerator) -> Callable:
    """all_gather into tensors of different sizes, as NCCL takes them ("all_gather_v").

    megatron-core's layer-wise distributed optimizer gathers each rank's updated parameters, flattened, into
    one tensor per rank of that rank's size (``LayerWiseDistributedOptimizer.allgather_params``; a rank without
    parameters sends an empty one); gloo checks every output against the input's size. Where the sizes differ,
    each rank's part is padded to the largest, gathered at one size and copied into its output.
    """

    @functools.wraps(original)
    def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False):
        if async_op or all(out.shape == tensor.shape for out in tensor_list):
            return original(tensor_list, tensor, group=group, async_op=async_op)
        largest = max(max(out.numel() for out in tensor_list), tensor.numel())
        padded = tensor.new_zeros(largest)
        padded[: tensor.numel()] = tensor.reshape(-1)
        parts = [torch.empty_like(padded) for _ in tensor_list]
        original(parts, padded, group=group)
        for out, part in zip(tensor_list, parts, strict=True):
            out.copy_(part[: out.numel()].view(out.shape))
        return None

    return all_gather


for _module in ("torch.distributed", "torch.distributed.distributed_c10d"):
    register(
        f"{_module}.all_gather.uneven",
        f"{_module}:all_gather",
        reason="megatron-core's layer-wise optimizer all-gathers per-rank tensors of different sizes (NCCL's "
        "all_gather_v); gloo: 'invalid tensor size' (dist_checkpointing/test_layer_wise_optimizer.py::"
        "test_layer_wise_optimizer_step); padded to the largest, gathered, trimmed",
        subsystem=SUBSYSTEM,
        requires="lacks_uneven_all_gather",
    )(uneven_all_gather)


# ----- gloo: a group's works one at a time ----------------------------------------------------
#: where gloo reads the interfaces to bind (torch's own constructor reads it too)
GLOO_INTERFACES_ENVVAR = "GLOO_SOCKET_IFNAME"


def _gloo_devices(gloo: type) -> list[Any]:
    """The devices torch's ProcessGroupGloo(store, rank, size, timeout) binds: one per interface in
    GLOO_SOCKET_IFNAME, else the default one (lazy connection as TORCH_GLOO_LAZY_INIT says)."""
    interfaces = [name for name in os.environ.get(GLOO_INTERFACES_ENVVAR, "").split(",") if name]
    if interfaces:
        return [gloo.create_device(interface=name) for name in interfaces]
    return [gloo.create_default_device()]


def one_worker_per_gloo_group(original: type, accelerator: Accelerator) -> type:
    """ProcessGroupGloo whose works run one at a time, in the order they were issued.

    Torch builds each gloo group with two worker threads, so two asynchronous works of one group
    run at once. In torch 2.13 that corrupts the heap: Megatron-FSDP prefetches the next layers'
    weights with an asynchronous all-gather while the next collective is issued (measured, 2 ranks,
    60 iterations: 7 of 15 runs died with glibc's "malloc(): unaligned tcache chunk detected" or
    SIGSEGV, caught in a gloo worker inside the coalesced all-gather; 0 of 15 with one worker thread,
    0 of 13 with the all-gathers made synchronous instead). With one worker a group's works still run beside the
    caller, never beside each other; they cannot deadlock, since every rank issues a group's works
    in the same order (its tags count them). torch's constructor takes no thread count, so the
    options it would build are built here, with one thread.
    """

    class AnyGlooBackend(type(original)):  # type: ignore[misc]
        """torch asks ``isinstance(backend, ProcessGroupGloo)`` of the backends a group hands back (timeouts,
        sequence numbers), and those come back as torch's own class once their Python object is collected:
        every gloo backend answers yes, as before."""

        def __instancecheck__(cls, instance: Any) -> bool:
            return isinstance(instance, original)

        def __subclasscheck__(cls, subclass: type) -> bool:
            return issubclass(subclass, original)

    class OneWorkerProcessGroupGloo(original, metaclass=AnyGlooBackend):  # type: ignore[misc,valid-type]
        def __init__(self, store: Any, rank: int, size: int, *args: Any, **kwargs: Any) -> None:
            given = args[0] if args else kwargs.get("options", kwargs.get("timeout"))
            if isinstance(given, original._Options):  # the caller's own options: theirs
                super().__init__(store, rank, size, given)
                return
            options = original._Options()
            options._devices = _gloo_devices(original)
            options._threads = 1
            if given is not None:
                options._timeout = given
            super().__init__(store, rank, size, options)

    OneWorkerProcessGroupGloo.__name__ = OneWorkerProcessGroupGloo.__qualname__ = original.__name__
    return OneWorkerProcessGroupGloo


register(
    "torch.distributed.distributed_c10d.ProcessGroupGloo.one_worker",
    "torch.distributed.distributed_c10d:ProcessGroupGloo",
    reason="gloo runs a group's asynchronous works on two threads, and two at once corrupt the heap (torch 2.13: "
    "Megatron-FSDP's prefetched all-gathers crashed 7 of 15 runs, SIGABRT/SIGSEGV); new groups get one worker",
    subsystem=SUBSYSTEM,
    requires="lacks_safe_work_overlap",
)(one_worker_per_gloo_group)
