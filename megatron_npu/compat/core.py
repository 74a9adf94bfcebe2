"""The shims, one per API gap (see the package docstring); imported lazily: no megatron-core at import."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from megatron_npu.version import installed_megatron_core


class ReleaseGap(RuntimeError):
    """The installed megatron-core lacks what a flag or feature needs; the message names the release."""


def _find(module: str, name: str) -> Any | None:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def gap(what: str, fix: str) -> ReleaseGap:
    return ReleaseGap(f"{what} is not in megatron-core {installed_megatron_core()}: {fix}")


def squared_relu(x: Any) -> Any:
    """``megatron.core.activations.squared_relu`` (0.14+); before, the same math: relu(x) ** 2."""
    core = _find("megatron.core.activations", "squared_relu")
    if core is not None:
        return core(x)
    import torch

    return torch.pow(torch.nn.functional.relu(x), 2)


def unwrap_model(model: Any) -> Any:
    """``megatron.core.utils.unwrap_model`` (0.14+); before, the same unwrapping of megatron-core's DDP and
    Float16Module wrappers (a list in, a list out)."""
    core = _find("megatron.core.utils", "unwrap_model")
    if core is not None:
        return core(model)
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    def one(module: Any) -> Any:
        while isinstance(module, (DistributedDataParallel, Float16Module)):
            module = module.module
        return module

    return [one(m) for m in model] if isinstance(model, list) else one(model)


def standard_megatron_optimizer(config: Any, model: list) -> Any:
    """megatron-core's optimizer with Megatron-LM's standard parameter groups: from 0.16 through
    ``get_standard_config_overrides`` (no weight decay on biases and norms, the decoupled LR group);
    before 0.16 ``get_megatron_optimizer`` builds those groups itself from the config."""
    from megatron.core.optimizer import get_megatron_optimizer

    overrides = _find("megatron.core.optimizer", "get_standard_config_overrides")
    if overrides is None:
        return get_megatron_optimizer(config, model)
    return get_megatron_optimizer(config, model, config_overrides=overrides(config=config))


def moe_layer_wise_logging_tracker() -> dict:
    """megatron-core's per-layer MoE metrics tracker (``get_moe_layer_wise_logging_tracker``, 0.13+)."""
    tracker = _find("megatron.core.transformer.moe.moe_utils", "get_moe_layer_wise_logging_tracker")
    if tracker is None:
        raise gap("the MoE layer-wise logging tracker", "MoE training with this trainer needs megatron-core >= 0.13")
    return tracker()


# megatron-core's own tokenizer builder moved: megatron.core.tokenizers.text.utils.build_tokenizer (0.15-0.18),
# megatron.core.tokenizers.utils.build_tokenizer (0.19).
_TOKENIZER_BUILDERS = (
    ("megatron.core.tokenizers.text.utils.build_tokenizer", "build_tokenizer"),
    ("megatron.core.tokenizers.utils.build_tokenizer", "build_tokenizer"),
)


def core_tokenizer_builder() -> Callable[[Any], Any]:
    """``build_tokenizer(args)`` of ``megatron.core.tokenizers`` (0.15+), wherever the release keeps it."""
    for module, name in _TOKENIZER_BUILDERS:
        found = _find(module, name)
        if callable(found):
            return found
    raise gap(
        "megatron.core.tokenizers (the default tokenizer system)",
        "pass --legacy-tokenizer (Megatron-LM's legacy tokenizers), or install megatron-core >= 0.15",
    )
