"""Selecting the accelerator: ``MEGATRON_NPU_DEVICE=auto|npu|cuda|cpu``.

auto picks npu when torch_npu imports, else cuda when available, else cpu.
This is the only place that decides the device type and collective backend.
"""

from __future__ import annotations

import os

from .base import Accelerator

DEVICE_ENVVAR = "MEGATRON_NPU_DEVICE"
TARGETS = ("auto", "npu", "cuda", "cpu")

_ACCELERATOR: Accelerator | None = None


class AcceleratorUnavailable(RuntimeError):
    """The requested target cannot run on this machine."""


def _npu_importable() -> bool:
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        from .npu import import_torch_npu

        import_torch_npu()
    except Exception:  # torch_npu without CANN raises ImportError/OSError/RuntimeError
        return False
    return True


def resolve_target(requested: str | None = None) -> str:
    """The concrete target ("npu", "cuda" or "cpu") for a requested one."""
    requested = (requested or os.environ.get(DEVICE_ENVVAR) or "auto").strip().lower()
    if requested not in TARGETS:
        raise AcceleratorUnavailable(
            f"{DEVICE_ENVVAR}={requested!r} is not a target; choose one of {', '.join(TARGETS)}"
        )
    if requested != "auto":
        return requested
    if _npu_importable():
        return "npu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def build_accelerator(target: str) -> Accelerator:
    if target == "cpu":
        from .cpu import CpuAccelerator

        return CpuAccelerator()
    if target == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise AcceleratorUnavailable(
                f"{DEVICE_ENVVAR}=cuda but torch sees no CUDA device; use {DEVICE_ENVVAR}=cpu or auto"
            )
        from .cuda import CudaAccelerator

        return CudaAccelerator()
    if target == "npu":
        try:
            from .npu import NpuAccelerator

            return NpuAccelerator()
        except Exception as error:
            raise AcceleratorUnavailable(
                f"{DEVICE_ENVVAR}=npu but torch_npu does not import ({error}); install "
                "megatron-npu[npu] and source CANN's set_env.sh, or use "
                f"{DEVICE_ENVVAR}=cpu"
            ) from error
    raise AcceleratorUnavailable(f"unknown target {target!r}")


def get_accelerator() -> Accelerator:
    """The process-wide accelerator (built on first use)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = build_accelerator(resolve_target())
    return _ACCELERATOR


def set_accelerator(accelerator: Accelerator | None) -> None:
    """Replace the process-wide accelerator (tests; None re-resolves on next use)."""
    global _ACCELERATOR
    _ACCELERATOR = accelerator


__all__ = [
    "Accelerator",
    "AcceleratorUnavailable",
    "DEVICE_ENVVAR",
    "build_accelerator",
    "get_accelerator",
    "resolve_target",
    "set_accelerator",
]
