"""The cuda target: upstream megatron-core behaviour; the patch set stands aside."""

from __future__ import annotations

import contextlib
from types import MappingProxyType
from typing import Any

import torch

from .base import Accelerator

# Dense bf16 peak TFLOP/s by device-name fragment, for MFU.
_CUDA_PEAK_BF16 = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "H800": 989.0, "A800": 312.0, "L40S": 362.0}


class CudaAccelerator(Accelerator):
    device_type = "cuda"
    communication_backend = "nccl"
    visible_devices_envvar = "CUDA_VISIBLE_DEVICES"
    # As Megatron-LM: nccl, or gloo (which moves CUDA tensors through the host).
    backend_aliases = MappingProxyType({"nccl": "nccl", "gloo": "gloo"})
    is_upstream = True
    supports_jit_fusion = True

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def profiler_activities(self) -> list:
        return [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, index: int | str | torch.device) -> None:
        torch.cuda.set_device(index)

    def device_name(self, index: int | None = None) -> str:
        return torch.cuda.get_device_name(index)

    def synchronize(self, device: Any = None) -> None:
        torch.cuda.synchronize(device)

    @property
    def Stream(self) -> type:  # noqa: N802
        return torch.cuda.Stream

    @property
    def Event(self) -> type:  # noqa: N802
        return torch.cuda.Event

    def current_stream(self, device: Any = None) -> Any:
        return torch.cuda.current_stream(device)

    def default_stream(self, device: Any = None) -> Any:
        return torch.cuda.default_stream(device)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def set_stream(self, stream: Any) -> None:
        torch.cuda.set_stream(stream)

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.cuda.get_rng_state() if device is None else torch.cuda.get_rng_state(device)

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        torch.cuda.set_rng_state(state) if device is None else torch.cuda.set_rng_state(state, device)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def default_generator(self, index: int | None = None) -> torch.Generator:
        return torch.cuda.default_generators[self.current_device() if index is None else index]

    def memory_allocated(self, device: Any = None) -> int:
        return torch.cuda.memory_allocated(device)

    def max_memory_allocated(self, device: Any = None) -> int:
        return torch.cuda.max_memory_allocated(device)

    def memory_reserved(self, device: Any = None) -> int:
        return torch.cuda.memory_reserved(device)

    def max_memory_reserved(self, device: Any = None) -> int:
        return torch.cuda.max_memory_reserved(device)

    def memory_stats(self, device: Any = None) -> dict[str, Any]:
        return torch.cuda.memory_stats(device)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def peak_tflops(self, dtype: torch.dtype = torch.bfloat16) -> float | None:
        if dtype not in (torch.bfloat16, torch.float16):
            return None
        name = self.device_name()
        return next((peak for key, peak in _CUDA_PEAK_BF16.items() if key in name), None)

    def versions(self) -> dict[str, str]:
        return {"cuda": str(torch.version.cuda)}
