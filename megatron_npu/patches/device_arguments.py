"""Device arguments: 'cuda', torch.device('cuda'), bare integers -> the accelerator.

GPU scripts and megatron-core pass CUDA devices to factory functions
(``torch.empty(..., device=torch.cuda.current_device())``, ``device="cuda"``),
call ``.cuda()`` and ``.to("cuda")``, load checkpoints with
``map_location="cuda"`` and open ``torch.autocast("cuda")``. These wrappers map
each such device to the accelerator's. They are plain function wrappers, not a
TorchFunctionMode: a mode is thread-local and is not active inside autograd's
backward, where megatron-core allocates too (tensor_parallel/layers.py:551 and
the recompute path), and a mode would tax every op, not only the factories.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

FOREIGN_DEVICE_TYPE = "cuda"
SUBSYSTEM = "device_arguments"

FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "as_tensor",
    "arange",
    "linspace",
    "logspace",
    "eye",
    "rand",
    "randn",
    "randint",
    "randperm",
    "normal",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
    "empty_strided",
    "scalar_tensor",
    "tril_indices",
    "triu_indices",
)
TENSOR_NEW = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def device_mapper(accelerator: Accelerator) -> Callable[[Any], Any]:
    """A function mapping CUDA device specs to the accelerator's device."""
    device_type = accelerator.device_type
    indexed = not accelerator.runs_on_host  # the host is one device: "cpu", never "cpu:1"

    def to_target(index: int | None) -> torch.device:
        return torch.device(device_type, index) if indexed and index is not None else torch.device(device_type)

    def map_device(device: Any) -> Any:
        if isinstance(device, str):
            if device.startswith(FOREIGN_DEVICE_TYPE):
                return to_target(torch.device(device).index)
            return device
        if isinstance(device, torch.device):
            return to_target(device.index) if device.type == FOREIGN_DEVICE_TYPE else device
        if isinstance(device, int) and not isinstance(device, bool):
            return to_target(device)
        return device

    return map_device


def _is_device_like(value: Any) -> bool:
    return isinstance(value, (str, torch.device)) or (isinstance(value, int) and not isinstance(value, bool))


def _factory_wrapper(original: Callable, accelerator: Accelerator) -> Callable:
    map_device = device_mapper(accelerator)
    drop_pinning = not accelerator.supports_pinned_memory()

    @functools.wraps(original)
    def factory(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None:
            kwargs["device"] = map_device(device)
        if drop_pinning and kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return original(*args, **kwargs)

    return factory


def _register_factory(name: str) -> None:
    register(
        f"torch.{name}.device",
        f"torch:{name}",
        reason=f"torch.{name}(device='cuda' | int) allocates on the accelerator instead",
        subsystem=SUBSYSTEM,
    )(_factory_wrapper)


def _register_tensor_new(name: str) -> None:
    register(
        f"torch.Tensor.{name}.device",
        f"torch:Tensor.{name}",
        reason=f"Tensor.{name}(device='cuda') allocates on the accelerator instead",
        subsystem=SUBSYSTEM,
    )(_factory_wrapper)


def _remember_torch_factories() -> None:
    """Let ``with torch.device(...)`` keep working after the factories are wrapped.

    torch's device context recognises factory calls by identity against a set it builds on
    first use (``torch.utils._device._device_constructors``, an lru_cache). Built after the
    wrappers are installed, it holds the wrappers, so the context no longer sees the original
    functions its mode is called with and ``with torch.device("meta")`` allocates on the host
    (transformers' ``from_pretrained`` then leaves buffers such as RoPE's ``inv_freq``
    uninitialised). Building it now, while ``torch.empty`` & co are the originals, keeps them.
    """
    try:
        from torch.utils._device import _device_constructors
    except ImportError:  # a torch without the device context: nothing to keep
        return
    _device_constructors()


_remember_torch_factories()
for _name in FACTORIES:
    _register_factory(_name)
for _name in TENSOR_NEW:
    _register_tensor_new(_name)


def _device_mapping_to(original: Callable, accelerator: Accelerator) -> Callable:
    """``.to(device, ...)`` of a tensor or a module, with the device (positional or keyword) mapped."""
    map_device = device_mapper(accelerator)

    @functools.wraps(original)
    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args and _is_device_like(args[0]):
            args = (map_device(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = map_device(kwargs["device"])
        return original(self, *args, **kwargs)

    return to


register(
    "torch.Tensor.to.device",
    "torch:Tensor.to",
    reason="tensor.to('cuda' | torch.device('cuda') | int) moves to the accelerator",
    subsystem=SUBSYSTEM,
)(_device_mapping_to)


@register(
    "torch.Tensor.cuda",
    "torch:Tensor.cuda",
    reason="tensor.cuda() moves to the accelerator's current device",
    subsystem=SUBSYSTEM,
)
def _tensor_cuda(original: Callable, accelerator: Accelerator) -> Callable:
    map_device = device_mapper(accelerator)

    def cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> torch.Tensor:
        target = accelerator.device() if device is None else map_device(device)
        return self.to(target, non_blocking=non_blocking, **kwargs)

    return cuda


@register(
    "torch.Tensor.pin_memory",
    "torch:Tensor.pin_memory",
    reason="pinning needs a device allocator; on the cpu target it is the identity",
    subsystem=SUBSYSTEM,
    requires="lacks_pinned_memory",
)
def _tensor_pin_memory(original: Callable, accelerator: Accelerator) -> Callable:
    def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    return pin_memory


@register(
    "torch.nn.Module.cuda",
    "torch.nn.modules.module:Module.cuda",
    reason="module.cuda() moves the module to the accelerator's current device",
    subsystem=SUBSYSTEM,
)
def _module_cuda(original: Callable, accelerator: Accelerator) -> Callable:
    map_device = device_mapper(accelerator)

    def cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
        return self.to(accelerator.device() if device is None else map_device(device))

    return cuda


register(
    "torch.nn.Module.to.device",
    "torch.nn.modules.module:Module.to",
    reason="module.to('cuda' | int) moves the module to the accelerator",
    subsystem=SUBSYSTEM,
)(_device_mapping_to)


@register(
    "torch.load.map_location",
    "torch:load",
    reason="torch.load(map_location='cuda') loads onto the accelerator",
    subsystem=SUBSYSTEM,
)
def _torch_load(original: Callable, accelerator: Accelerator) -> Callable:
    map_device = device_mapper(accelerator)

    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        location = kwargs.get("map_location")
        if isinstance(location, dict):
            kwargs["map_location"] = {key: str(map_device(value)) for key, value in location.items()}
        elif location is not None and _is_device_like(location):
            kwargs["map_location"] = map_device(location)
        return original(*args, **kwargs)

    return load


@register(
    "torch.autocast.device_type",
    "torch.amp.autocast_mode:autocast.__init__",
    reason="torch.autocast('cuda') in megatron's forward_step becomes the accelerator's autocast",
    subsystem=SUBSYSTEM,
)
def _autocast_init(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def __init__(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        if device_type == FOREIGN_DEVICE_TYPE:
            device_type = accelerator.autocast_device_type()
        original(self, device_type, *args, **kwargs)

    return __init__
