"""megatron-core 0.16 faults off CUDA that its own unit tests found (tests/conformance, issue #27).

Each is a megatron-core bug that CUDA with Transformer Engine hides; each patch keeps
megatron-core's behaviour where TE is installed and only answers what it gets wrong without it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "megatron_core_fixes"
VERIFIED = ">=0.16.0,<0.17"  # each fault read and reproduced on megatron-core 0.16.1


@register(
    "utils.is_te_min_version.without_te",
    "megatron.core.utils:is_te_min_version",
    reason="compares get_te_version() (None without Transformer Engine) with a Version: TypeError at import of "
    "transformer/attention, moe and dist_checkpointing modules (megatron-core's unit tests: collection errors); "
    "without TE no minimum TE version is met: False",
    subsystem=SUBSYSTEM,
    megatron_versions=VERIFIED,
)
def _is_te_min_version(original: Callable, accelerator: Accelerator) -> Callable:
    from megatron.core.utils import get_te_version

    @functools.wraps(original)
    def is_te_min_version(version: str, check_equality: bool = True) -> bool:
        if get_te_version() is None:
            return False
        return original(version, check_equality)

    return is_te_min_version


@register(
    "tensor_parallel.random.CheckpointWithoutOutput.__init__.fp8",
    "megatron.core.tensor_parallel.random:CheckpointWithoutOutput.__init__",
    reason="sets self.fp8 = fp8 is not None, so fp8=False turns fp8 on and forward() reaches TE's "
    "FP8GlobalStateManager (NameError without TE; tensor_parallel/test_random.py); fp8 is on when given and truthy",
    subsystem=SUBSYSTEM,
    megatron_versions=VERIFIED,
)
def _checkpoint_without_output_init(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def __init__(self: Any, fp8: Any = False) -> None:  # noqa: N807
        original(self, fp8)
        self.fp8 = bool(fp8)  # config.fp8 is None or a recipe name: both read right

    return __init__


@register(
    "optimizer._get_megatron_optimizer_based_on_param_groups.torch_lr",
    "megatron.core.optimizer:_get_megatron_optimizer_based_on_param_groups",
    reason="passes OptimizerConfig.lr (None by default) to the optimizer; TE/Apex FusedAdam keep None until the "
    "scheduler sets each group's lr, the torch AdamW fallback raises TypeError (dist_checkpointing/"
    "test_optimizer.py): the torch optimizer is built with lr 0.0 in its place, the config keeps None",
    subsystem=SUBSYSTEM,
    megatron_versions=VERIFIED,
)
def _torch_optimizer_lr(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def build(config: Any, *args: Any, **kwargs: Any) -> Any:
        from megatron.core import optimizer as megatron_optimizer

        if config.lr is not None or not getattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False):
            return original(config, *args, **kwargs)
        config.lr = 0.0  # read once, by the torch optimizer's constructor inside this call
        try:
            return original(config, *args, **kwargs)
        finally:
            config.lr = None

    return build


# The three CUDA extensions forward_fused_softmax imports (causal, masked, unmasked).
SOFTMAX_EXTENSIONS = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda")


@register(
    "fusions.fused_softmax.FusedScaleMaskSoftmax.is_kernel_available.extension",
    "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.is_kernel_available",
    reason="chooses the fused softmax by shape alone and then imports its CUDA extension: ModuleNotFoundError "
    "'scaled_masked_softmax_cuda' wherever it is not built (transformer/moe/test_upcycling.py, masked_softmax_"
    "fusion on by default in Megatron-LM's arguments); without the extensions the kernel is not available, so "
    "megatron-core's own torch softmax runs",
    subsystem=SUBSYSTEM,
    megatron_versions=VERIFIED,
)
def _softmax_kernel_needs_extension(original: Callable, accelerator: Accelerator) -> Callable:
    import importlib.util

    built = all(importlib.util.find_spec(name) is not None for name in SOFTMAX_EXTENSIONS)

    @functools.wraps(original)
    def is_kernel_available(self: Any, *args: Any, **kwargs: Any) -> bool:
        return built and original(self, *args, **kwargs)

    return is_kernel_available
