"""megatron-core modules that import triton unguarded, for the releases where a model import reaches them.

From 0.18 ``gpt_model.py``, ``pipeline_parallel/schedules.py`` and ``moe/experts.py`` import the MoE paged stash,
whose module imports triton (0.18: ``moe/paged_stash.py`` itself; 0.19: its kernels, ``moe/ops/paged_stash.py``).
CPU torch and torch_npu have no triton, so ``import megatron.core.models.gpt`` would fail. Where triton is
importable the real module loads; where it is not, a stand-in with the names the importers use loads instead: it
does what the real one does while ``moe_paged_stash`` is off and refuses the flag when it is on (the stash's copy
kernels are triton kernels). The decision asks for triton itself (a capability), not for a device.

Emerging-Optimizers v0.1.0 (megatron-core 0.16's pin for its Muon optimizer, ``optimizer/muon.py``) imports its
triton SYRK kernel unguarded from ``orthogonalized_optimizers``: without triton megatron-core finds no Muon
(``HAVE_EMERGING_OPTIMIZERS`` False) and ``optimizer='muon'`` / ``'dist_muon'`` fail. Emerging-Optimizers v0.4.0
guards that import itself (no kernel, ``HAS_TRITON_340`` False); the same stand-in loads here for the releases
that do not.
"""

from __future__ import annotations

import importlib
import sys
import types
from contextlib import nullcontext
from typing import Any

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "triton_imports"
STASH_018 = "megatron.core.transformer.moe.paged_stash"
STASH_KERNELS_019 = "megatron.core.transformer.moe.ops.paged_stash"
EO_KERNELS = "emerging_optimizers.triton_kernels"
REFUSAL = "--moe-paged-stash (moe_paged_stash) needs triton, which is not installed here: turn it off"
SYRK_REFUSAL = (
    "Muon's use_syrk needs Emerging-Optimizers' triton SYRK kernel; triton is not installed here: turn it off"
)


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(REFUSAL)


def _refuse_syrk(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(SYRK_REFUSAL)


def _stand_in(name: str, attributes: dict[str, Any], refusal: str = REFUSAL) -> types.ModuleType:
    module = types.ModuleType(name, f"stand-in for {name} (triton is not importable): {refusal}")
    module.__dict__.update(attributes)
    module.__megatron_npu_stand_in__ = True  # type: ignore[attr-defined]
    sys.modules[name] = module  # `from <name> import x` reads sys.modules
    return module


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _real_or_stand_in(name: str, attributes: dict[str, Any], refusal: str = REFUSAL) -> types.ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    if triton_importable():
        return importlib.import_module(name)
    return _stand_in(name, attributes, refusal)


def _paged_stash_reset(enabled: bool = True, config: Any = None) -> None:
    if enabled:  # the schedules call it only when config.moe_paged_stash is set
        _refuse()


@register(
    "moe.paged_stash.without_triton",
    "megatron.core.transformer.moe:paged_stash",
    reason="0.18: gpt_model, schedules and experts import moe/paged_stash, which imports triton unguarded; "
    "without triton a stand-in (paged stash off: the identity, as upstream when disabled) loads instead",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.18.0,<0.19",
    create=True,
)
def _paged_stash_018(original: Any, accelerator: Accelerator) -> types.ModuleType:
    return _real_or_stand_in(
        STASH_018,
        {
            "paged_stash_group_start": lambda tensor: tensor,
            "paged_stash_group_commit": lambda tensor, name=None: tensor,
            "get_paged_stash_context": lambda *args, **kwargs: nullcontext(),
            "paged_stash_init_chunk_handler": lambda vp_size, vp_stage: None,
            "paged_stash_reset": _paged_stash_reset,
            "check_paged_stash_overflow": lambda: False,
            "check_paged_stash_host_spill": lambda: False,
        },
    )


@register(
    "moe.ops.paged_stash.without_triton",
    "megatron.core.transformer.moe.ops:paged_stash",
    reason="0.19: moe/paged_stash (imported by gpt_model, schedules, experts) imports its triton kernels from "
    "moe/ops/paged_stash unguarded; without triton the kernels are a stand-in that refuses moe_paged_stash",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.19.0,<0.20",
    create=True,
)
def _paged_stash_kernels_019(original: Any, accelerator: Accelerator) -> types.ModuleType:
    attributes = {"GLOBAL_BLOCK_SIZE": 1024, "paged_stash_copy_kernel": _refuse, "paged_stash_pop_kernel": _refuse}
    return _real_or_stand_in(STASH_KERNELS_019, attributes)


@register(
    "emerging_optimizers.triton_kernels.without_triton",
    "emerging_optimizers:triton_kernels",
    reason="Emerging-Optimizers v0.1.0 (megatron-core 0.16's Muon) imports its triton SYRK kernel unguarded, so "
    "without triton megatron-core has no Muon; a stand-in without the kernel (HAS_TRITON_340 False, as "
    "Emerging-Optimizers v0.4.0 does without triton) loads instead, and use_syrk is refused",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.16.0,<0.17",
    create=True,
)
def _emerging_optimizers_kernels(original: Any, accelerator: Accelerator) -> types.ModuleType:
    attributes = {"HAS_TRITON_340": False, "tsyrk_ex": _refuse_syrk}
    return _real_or_stand_in(EO_KERNELS, attributes, SYRK_REFUSAL)
