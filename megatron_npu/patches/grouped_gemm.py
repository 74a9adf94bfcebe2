"""Grouped GEMM: megatron-core's ``grouped_gemm_util`` answered by the project's grouped GEMM.

megatron-core 0.12-0.16's legacy ``GroupedMLP`` (``--moe-grouped-gemm`` with the local spec, Megatron-LM's
``--transformer-impl local``) needs the ``grouped_gemm`` package (CUTLASS kernels, CUDA-only):
``grouped_gemm_util`` imports it in a ``try`` and binds ``grouped_gemm`` and ``ops`` to None without it, so
``GroupedMLP.__init__`` stops at ``assert_grouped_gemm_is_available()``. Where the package is absent, both names
are answered by megatron_npu/ops/grouped_gemm.py's ``gmm`` (the accelerator's ``grouped_matmul`` kernel, torch_npu's
grouped matmul on npu; the per-expert math elsewhere); an installed package is never shadowed (the patch returns
megatron-core's own binding). Nothing goes into ``sys.modules``: ``import grouped_gemm`` still fails as it did.
0.17 removed ``grouped_gemm_util`` with the legacy GroupedMLP.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "grouped_gemm"
UTIL = "megatron.core.transformer.moe.grouped_gemm_util"
#: grouped_gemm_util.py is the same file in 0.12.1 ... 0.16.1 (GroupedMLP reads grouped_gemm_is_available() and
#: ops.gmm(a, b, batch_sizes, trans_b=False) only); 0.17 removed it.
RELEASES = ">=0.12.0,<0.17"


def _gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    # imported when called: megatron_npu.ops.grouped_gemm imports megatron-core's experts.py, the module whose
    # import of grouped_gemm_util applies this patch
    from megatron_npu.ops.grouped_gemm import gmm

    return gmm(a, b, batch_sizes, trans_b=trans_b)


def stand_in() -> types.SimpleNamespace:
    """What megatron-core reads of the package: ``grouped_gemm.ops.gmm``."""
    ops = types.SimpleNamespace(gmm=_gmm)
    return types.SimpleNamespace(ops=ops, __megatron_npu_stand_in__=True)


STAND_IN = stand_in()


def serves_grouped_gemm() -> bool:
    """True when megatron-core's grouped GEMM is this project's (the package absent, the patch applied)."""
    if importlib.util.find_spec(UTIL) is None:  # 0.17+: no legacy GroupedMLP
        return False
    util = importlib.import_module(UTIL)  # imported, it is patched
    return getattr(util.grouped_gemm, "__megatron_npu_stand_in__", False)


@register(
    "grouped_gemm_util.grouped_gemm",
    f"{UTIL}:grouped_gemm",
    reason="GroupedMLP (--moe-grouped-gemm, local spec) asserts the grouped_gemm package (CUDA kernels), None "
    "without it: where it is absent, the project's grouped GEMM answers grouped_gemm_is_available()",
    subsystem=SUBSYSTEM,
    megatron_versions=RELEASES,
)
def _grouped_gemm(original: Any, accelerator: Accelerator) -> Any:
    return original if original is not None else STAND_IN


@register(
    "grouped_gemm_util.ops",
    f"{UTIL}:ops",
    reason="GroupedMLP.forward calls grouped_gemm_util.ops.gmm (None without the package): the project's grouped "
    "GEMM (the accelerator's grouped_matmul kernel, or the per-expert math) with the package's signature",
    subsystem=SUBSYSTEM,
    megatron_versions=RELEASES,
)
def _ops(original: Any, accelerator: Accelerator) -> Any:
    return original if original is not None else STAND_IN.ops


@register(
    "GroupedMLP.__init__.unfused_activation",
    "megatron.core.transformer.moe.experts:GroupedMLP.__init__",
    reason="GroupedMLP compiles its GLU and probability-scaled activation with experts.py's own jit_fuser "
    "(torch.compile, bound at import: Megatron-LM's --disable-jit-fuser does not reach it) whatever the fusion "
    "flags; where the accelerator has no jit fuser they are built as plain functions (on cpu inductor's C++ build "
    "took tens of seconds per process, in compile workers)",
    subsystem=SUBSYSTEM,
    megatron_versions=RELEASES,  # GroupedMLP.__init__'s two jit_fuser'd closures: 0.12.1 ... 0.16.1
    requires="lacks_jit_fusion",
)
def _grouped_mlp_init(original: Callable[..., None], accelerator: Accelerator) -> Callable[..., None]:
    experts = sys.modules[original.__module__]

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        # experts.jit_fuser is read while __init__ decorates its closures; swapping the module global for the
        # construction only keeps the registry from rebinding every alias of torch.compile
        compiled = experts.jit_fuser
        experts.jit_fuser = _unfused
        try:
            original(self, *args, **kwargs)
        finally:
            experts.jit_fuser = compiled

    return __init__


def _unfused(function: Callable) -> Callable:
    return function
