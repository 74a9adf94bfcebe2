"""Faults of particular megatron-core releases without Transformer Engine (CPU torch, torch_npu).

Each patch here applies only to the releases it names: a later release fixed the fault upstream.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import types
from collections.abc import Callable
from typing import Any

import numpy

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

from .optimizer import keep_source_keys

SUBSYSTEM = "release_fixes"


@register(
    "fp8_utils.quantize_param_shard.no_fp8_params",
    "megatron.core.fp8_utils:quantize_param_shard",
    reason="0.12.x: the distributed optimizer casts its fp8 params after every step, and without Transformer "
    "Engine the cast raises 'Invalid Transformer Engine version' even when there are no fp8 params (0.13 "
    "returns early on an empty list): the same early return",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.12.0,<0.13",
)
def _quantize_param_shard(original: Callable[..., None], accelerator: Accelerator) -> Callable[..., None]:
    @functools.wraps(original)
    def quantize_param_shard(model_params: list, *args: Any, **kwargs: Any) -> None:
        if len(model_params) == 0:
            return None
        return original(model_params, *args, **kwargs)

    return quantize_param_shard


class _NumpyWithProduct(types.ModuleType):
    """numpy, plus ``product`` (removed in NumPy 2.0; the same function as ``prod``)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(numpy, name)


def _numpy_with_product(original: types.ModuleType, accelerator: Accelerator) -> types.ModuleType:
    if hasattr(original, "product"):  # NumPy 1.x: nothing to add
        return original
    proxy = _NumpyWithProduct(original.__name__, original.__doc__)
    proxy.product = original.prod  # type: ignore[attr-defined]
    return proxy


# Up to 0.15.x dist_checkpointing calls np.product on the flattened-range path: the distributed optimizer's
# default checkpoint layout before 0.15. With NumPy 2 (what torch 2.13 installs beside) a save raises
# AttributeError. One patch per module that calls it.
for _module in ("mapping", "validation", "exchange_utils"):
    register(
        f"dist_checkpointing.{_module}.np.product",
        f"megatron.core.dist_checkpointing.{_module}:np",
        reason="calls np.product, removed in NumPy 2.0: numpy with product = prod",
        subsystem=SUBSYSTEM,
        megatron_versions=">=0.12.0,<0.16",
    )(_numpy_with_product)


@register(
    "dist_checkpointing.filesystem_async._write_item.serialization_format",
    "megatron.core.dist_checkpointing.strategies.filesystem_async:_write_item",
    reason="0.12.x calls torch's private _write_item without serialization_format, which newer torch requires "
    "(every torch_dist save fails); 0.13 passes TORCH_SAVE where the parameter exists: the same",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.12.0,<0.13",
)
def _write_item(original: Callable[..., Any], accelerator: Accelerator) -> Callable[..., Any]:
    if "serialization_format" not in inspect.signature(original).parameters:
        return original
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    @functools.wraps(original)
    def write_item(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("serialization_format", SerializationFormat.TORCH_SAVE)
        return original(*args, **kwargs)

    return write_item


register(
    "distrib_optimizer._set_main_param_and_optimizer_states.source_keys.config_0_12",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states",
    reason="iterates the destination keys, which include torch AdamW's 'step' that the checkpoint drops "
    "(KeyError on load): megatron_npu/patches/optimizer.py's fix, under 0.12's name of the precision-aware switch "
    "(use_precision_aware_optimizer; 0.13 renamed what it reads)",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.12.0,<0.13",
)(keep_source_keys("use_precision_aware_optimizer"))


@register(
    "utils.is_te_min_version.without_te_0_12",
    "megatron.core.utils:is_te_min_version",
    reason="0.12.x: get_te_version imports transformer_engine unguarded, so Megatron-LM's checkpoint loading "
    "(fix_fp8_params_lose_precision_when_loading_dist_ckpt) raises ModuleNotFoundError without TE; without TE "
    "no minimum TE version is met: False (megatron_core_fixes.py covers 0.16's variant)",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.12.0,<0.13",
)
def _is_te_min_version_012(original: Callable[..., bool], accelerator: Accelerator) -> Callable[..., bool]:
    @functools.wraps(original)
    def is_te_min_version(version: str, check_equality: bool = True) -> bool:
        if importlib.util.find_spec("transformer_engine") is None:
            return False
        return original(version, check_equality)

    return is_te_min_version


@register(
    "optimizer.ChainedOptimizer.count_zeros.unless_logged_0_12",
    "megatron.core.optimizer.optimizer:ChainedOptimizer.count_zeros",
    reason="0.12.x: ChainedOptimizer.step counts the gradients' zeros on every step (a reduction over the grad-stats "
    "group) whatever log_num_zeros_in_grad says, so the trainer reports 'num zeros' unasked; 0.13 counts only when "
    "log_num_zeros_in_grad is set and returns None otherwise: the same",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.12.0,<0.13",
)
def _count_zeros_012(original: Callable[..., Any], accelerator: Accelerator) -> Callable[..., Any]:
    @functools.wraps(original)
    def count_zeros(self: Any) -> Any:
        if self.config is not None and not self.config.log_num_zeros_in_grad:
            return None
        return original(self)

    return count_zeros


def _with_0_16_safe_globals(original: Callable[..., Any], accelerator: Accelerator) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        import io
        import signal

        import torch
        from megatron.core.optimizer import OptimizerConfig  # here: the patch applies while megatron.core imports

        with torch.serialization.safe_globals([io.BytesIO, signal.Signals, OptimizerConfig]):
            return original(*args, **kwargs)

    return load


# 0.14-0.15 load a checkpoint's common and sharded objects with torch.load's weights_only default (True since torch
# 2.6) and allow fewer classes than 0.16 (megatron/core/safe_globals.py): Megatron-LM 0.16's arguments, which this
# trainer's checkpoints carry (signal.Signals for --exit-signal, OptimizerConfig, BytesIO), fail to unpickle. 0.12
# and 0.13 pass weights_only=False. The three classes 0.16 adds, allowed while these methods load.
for _method in ("load_common", "load_sharded_objects"):
    register(
        f"dist_checkpointing.TorchCommonLoadStrategy.{_method}.safe_globals_0_16",
        f"megatron.core.dist_checkpointing.strategies.common:TorchCommonLoadStrategy.{_method}",
        reason="torch.load (weights_only) refuses Signals, BytesIO and OptimizerConfig, which 0.16 allows and "
        "Megatron-LM 0.16's checkpoint arguments hold: allowed while the method loads",
        subsystem=SUBSYSTEM,
        megatron_versions=">=0.14.0,<0.16",
    )(_with_0_16_safe_globals)
