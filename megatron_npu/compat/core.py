"""The shims, one per API gap (see the package docstring); imported lazily: no megatron-core at import."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from megatron_npu.version import installed_megatron_core


class ReleaseGap(RuntimeError):
    """The installed megatron-core lacks what a flag or feature needs; the message names the release."""


def find(module: str, name: str) -> Any | None:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def gap(what: str, fix: str) -> ReleaseGap:
    return ReleaseGap(f"{what} is not in megatron-core {installed_megatron_core()}: {fix}")


def squared_relu(x: Any) -> Any:
    """``megatron.core.activations.squared_relu`` (0.14+); before, the same math: relu(x) ** 2."""
    core = find("megatron.core.activations", "squared_relu")
    if core is not None:
        return core(x)
    import torch

    return torch.pow(torch.nn.functional.relu(x), 2)


def quick_gelu() -> Any:
    """``megatron.core.fusions.fused_bias_geglu.quick_gelu`` (gpt-oss's activation; 0.15+), or ``ReleaseGap``."""
    found = find("megatron.core.fusions.fused_bias_geglu", "quick_gelu")
    if found is None:
        raise gap("gpt-oss's quick-GeLU activation", "drop --quick-geglu, or use a later release")
    return found


def layer_window(config: Any, layer_number: int) -> Any:
    """This layer's sliding window, or None: megatron-core's ``is_layer_window_attention`` over the config's
    ``window_size`` / ``window_attn_skip_freq`` (0.13+); a release without them has no windows."""
    is_window_layer = find("megatron.core.transformer.utils", "is_layer_window_attention")
    window = getattr(config, "window_size", None)
    if is_window_layer is None or window is None:
        return None
    return window if is_window_layer(window, config.window_attn_skip_freq, layer_number) else None


def softmax_type(config: Any) -> str:
    """``TransformerConfig.softmax_type`` (0.15+; before, always megatron-core's vanilla softmax)."""
    return getattr(config, "softmax_type", "vanilla")


def unwrap_model(model: Any) -> Any:
    """``megatron.core.utils.unwrap_model`` (0.14+); before, the same unwrapping of megatron-core's DDP and
    Float16Module wrappers (a list in, a list out)."""
    core = find("megatron.core.utils", "unwrap_model")
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

    overrides = find("megatron.core.optimizer", "get_standard_config_overrides")
    if overrides is None:
        return get_megatron_optimizer(config, model)
    return get_megatron_optimizer(config, model, config_overrides=overrides(config=config))


def moe_layer_wise_logging_tracker() -> dict:
    """megatron-core's per-layer MoE metrics tracker: ``moe_utils.get_moe_layer_wise_logging_tracker`` (0.13+);
    0.12 keeps the same dict in ``parallel_state`` (same name, same keys: what its track_moe_metrics reads)."""
    for module in ("megatron.core.transformer.moe.moe_utils", "megatron.core.parallel_state"):
        tracker = find(module, "get_moe_layer_wise_logging_tracker")
        if tracker is not None:
            return tracker()
    raise gap("the MoE layer-wise logging tracker", "MoE training with this trainer needs megatron-core >= 0.12")


def takes_vp_stage(function: Callable[..., Any]) -> bool:
    """Whether a megatron-core function takes the virtual pipeline stage as an argument (0.13+)."""
    return "vp_stage" in inspect.signature(function).parameters


def _no_vp_stage() -> ReleaseGap:
    return gap(
        "a virtual pipeline stage argument (vp_stage)",
        "drop --num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank, "
        "or use megatron-core >= 0.13",
    )


def check_virtual_pipeline_support() -> None:
    """Asked at start-up when the run has virtual pipeline stages (before any process group): the model is
    built per stage through functions taking ``vp_stage``; a release without it (0.12) is ``ReleaseGap`` now,
    not when the model is built."""
    from megatron.core import parallel_state

    if not takes_vp_stage(parallel_state.is_pipeline_first_stage):
        raise _no_vp_stage()


def call_with_vp_stage(function: Callable[..., Any], *args: Any, vp_stage: int | None, **kwargs: Any) -> Any:
    """``function(*args, vp_stage=vp_stage, **kwargs)``: megatron-core 0.13+ takes the virtual pipeline stage as
    an argument (parallel_state's stage tests, the layer offset, GPTModel); 0.12 has no such argument and
    reads a global instead, which this trainer does not drive: without virtual stages the argument is left out,
    with them ``ReleaseGap`` (start-up refuses them first: check_virtual_pipeline_support)."""
    if takes_vp_stage(function):
        return function(*args, vp_stage=vp_stage, **kwargs)
    if vp_stage is None:
        return function(*args, **kwargs)
    raise _no_vp_stage()


def get_batch_on_this_cp_rank(batch: dict, **kwargs: Any) -> dict:
    """``megatron.core.utils.get_batch_on_this_cp_rank``: from 0.18 it also takes ``is_hybrid_cp`` (required),
    for hybrid context parallelism, which this trainer does not offer: False, the plain CP split before 0.18.
    Where it takes ``cp_group`` (0.16+) the context-parallel group is passed: 0.18+ read a missing one as the
    world group (torch's default), which splits the sequence over every rank."""
    from megatron.core import parallel_state, utils

    parameters = inspect.signature(utils.get_batch_on_this_cp_rank).parameters
    if "is_hybrid_cp" in parameters:
        kwargs.setdefault("is_hybrid_cp", False)
    if "cp_group" in parameters:
        kwargs.setdefault("cp_group", parallel_state.get_context_parallel_group())
    return utils.get_batch_on_this_cp_rank(batch, **kwargs)


def fully_reshardable_optimizer_formats() -> tuple[str, ...]:
    """The distributed optimizer's checkpoint layouts that load under another TP/PP layout:
    ``DistributedOptimizer.checkpoint_fully_reshardable_formats`` (0.15+); a release without that layout has
    none (0.13-0.14: this trainer's checkpoints there hold no distributed-optimizer state, check_checkpoint_support)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return tuple(getattr(DistributedOptimizer, "checkpoint_fully_reshardable_formats", ()))


def check_checkpoint_support(distributed_optimizer: bool) -> None:
    """What this trainer's checkpoints need from megatron-core (checkpoint_format.py), asked at start-up so
    a run never trains to its first save to fail there: ``dist_checkpointing.save`` taking content metadata
    (0.13+), and with the distributed optimizer its ``fully_reshardable`` layout (0.15+). ``ReleaseGap``
    where the installed release lacks either."""
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if "content_metadata" not in inspect.signature(dist_checkpointing.save).parameters:
        raise gap("dist_checkpointing with content metadata (this trainer's checkpoints)", "drop --save / --load")
    if distributed_optimizer and not hasattr(DistributedOptimizer, "checkpoint_fully_reshardable_formats"):
        raise gap(
            "the distributed optimizer's fully reshardable checkpoint layout",
            "drop --use-distributed-optimizer, or --save / --load",
        )


def check_mtp_support() -> None:
    """Asked at start-up when the run has ``--mtp-num-layers`` (before any process group): this trainer places
    the MTP block with megatron-core's ``mtp_on_this_rank`` (0.16+) and builds it with
    ``get_gpt_mtp_block_spec_for_backend`` (0.13+); ``ReleaseGap`` where the release lacks either."""
    for module, name in (
        ("megatron.core.transformer.multi_token_prediction", "mtp_on_this_rank"),
        ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_mtp_block_spec_for_backend"),
    ):
        if find(module, name) is None:
            raise gap(
                f"multi-token prediction as this trainer builds it ({name})",
                "drop --mtp-num-layers, or install megatron-core >= 0.16",
            )


def checkpoint_write_results_queue() -> Any:
    """The queue megatron-core's checkpoint writers report their results through, its spawned Manager started on
    the first call: ``filesystem_async.get_write_results_queue`` (0.17+), ``_get_write_results_queue`` before."""
    module = "megatron.core.dist_checkpointing.strategies.filesystem_async"
    return (find(module, "get_write_results_queue") or find(module, "_get_write_results_queue"))()


def mtp_on_this_rank(config: Any) -> bool:
    """megatron-core's ``mtp_on_this_rank`` (0.16+; check_mtp_support refuses MTP where it is missing)."""
    return find("megatron.core.transformer.multi_token_prediction", "mtp_on_this_rank")(config, ignore_virtual=True)


def mtp_block_spec_for_backend(config: Any, layer_spec: Any, backend: Any, vp_stage: int | None) -> Any:
    """megatron-core's ``get_gpt_mtp_block_spec_for_backend`` (0.13+; check_mtp_support refuses MTP before it)."""
    build = find("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_mtp_block_spec_for_backend")
    return build(config, layer_spec, backend=backend, vp_stage=vp_stage)
