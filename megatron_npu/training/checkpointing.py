"""Megatron-LM checkpoints with megatron-core dist-checkpointing (``torch_dist``).

Layout on disk, as Megatron-LM writes it::

    SAVE/latest_checkpointed_iteration.txt      "100"
    SAVE/iter_0000100/                          dist-ckpt: .metadata, *.distcp, common.pt, metadata.json

A save is written to ``iter_NNNNNNN.partial`` and renamed when every rank has
finished, then the tracker file is replaced atomically: a process killed mid-save
leaves the previous checkpoint and tracker untouched; the next start removes what it
left (``clean_unfinished_saves``) and says so. The distributed optimizer is
saved ``fully_reshardable`` (the only format of megatron-core 0.16 that both
saves and reshards), so a checkpoint loads under another TP/PP/DP layout. The RNG
states are per (PP, TP) rank and are restored only when the layout is unchanged. What is
replicated over DP is written shared among the DP ranks (--ckpt-fully-parallel-save, Megatron-LM's
default), else by DP rank 0.

The common state holds Megatron-LM core_v0.16.1's fields beside this trainer's
(checkpoint_format.py): Megatron-LM's pretrain_gpt.py resumes these checkpoints, and this
loader resumes Megatron-LM's, each with its data position, RNG and optimizer state.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import signal
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

from megatron_npu.accelerator import get_accelerator
from megatron_npu.compat import checkpoint_write_results_queue, fully_reshardable_optimizer_formats, unwrap_model
from megatron_npu.training import fsdp
from megatron_npu.training.arguments import ConfigError
from megatron_npu.training.checkpoint_format import (
    CHECKPOINT_VERSION,
    MODEL_SHAPE_ARGS,
    CheckpointedRun,
    SavedRun,
    content_metadata,
    megatron_args,
    megatron_rng,
)
from megatron_npu.training.global_vars import print_rank_0
from megatron_npu.training.moe_checkpoint import adapt_optimizer_state, saved_optimizer_count
from megatron_npu.training.run_state import RunState
from megatron_npu.training.sections import CheckpointSection

TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if text == "release":
        raise ConfigError(f"{path} says 'release' (a converted Megatron-LM checkpoint): use --finetune with it")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{path}: expected an iteration number, found {text!r}") from None


def _layout() -> dict[str, int | None]:
    layout = {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "vpp": parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
    }
    # MoE: the experts' grid, recorded only when it differs from the dense one (so checkpoints
    # saved before it was recorded still compare equal)
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    if ep > 1 or etp != layout["tp"]:
        layout |= {"ep": ep, "etp": etp}
    return layout


def _rng_state() -> dict[str, Any]:
    """This rank's RNG states, under Megatron-LM's keys."""
    return megatron_rng(
        {
            "random": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "device": get_accelerator().get_rng_state(),
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
        }
    )


def _set_rng_state(saved: dict[str, Any]) -> None:
    state = megatron_rng(saved)
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    get_accelerator().set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _rng_object(*, per_dp_rank: bool, by_dp: bool) -> ShardedObject:
    """The RNG states as Megatron-LM's get_rng_state shards them: one object per (PP, TP) rank,
    replicated over DP, or per (PP, TP, DP) rank under EP > 1; with --data-parallel-random-init,
    each holds the states of every DP rank."""
    states = [_rng_state()]
    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    if per_dp_rank and dp_size > 1:
        states = [None] * dp_size
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        dist.all_gather_object(states, _rng_state(), group=group)
    shape = (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    offset = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank())
    if by_dp:
        return ShardedObject("rng_state", states, (*shape, dp_size), (*offset, dp_rank), replica_id=0)
    return ShardedObject("rng_state", states, shape, offset, replica_id=dp_rank)


def _model_keys(model: list) -> list[str]:
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def _sharded_state(
    model: list, optimizer: Any, scheduler: Any, *, optim: bool, metadata: dict, loading: bool
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    # as Megatron-LM's generate_state_dict: the DP x CP group, which a last stage holding MTP layers reads to
    # tie its copy of the embedding to the first stage's
    model_metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    for key, chunk in zip(_model_keys(model), model, strict=True):
        state[key] = unwrap_model(chunk).sharded_state_dict(metadata=model_metadata)
    if optim:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def save_strategy(checkpoint: CheckpointSection) -> FullyParallelSaveStrategyWrapper | None:
    """The torch_dist save strategy of Megatron-LM's save_checkpoint: under --ckpt-fully-parallel-save (its
    default) megatron-core's ``FullyParallelSaveStrategyWrapper`` over the DP x CP group, which spreads the writing
    of what is replicated over DP (the weights, and the distributed optimizer's fully reshardable state, gathered on
    every DP rank) evenly over its ranks; else None (megatron-core's default: DP rank 0 writes each replica).
    The distribution is planned afresh at every save (--ckpt-assume-constant-structure is ignored). Every rank,
    once the process groups exist. ``TorchDistSaveShardedStrategy("torch_dist", 1)`` is megatron-core's default
    strategy, constructed alike on 0.12-0.19 (0.17 deprecates the getter Megatron-LM 0.16.1 calls)."""
    if checkpoint.ckpt_format != "torch_dist" or not checkpoint.ckpt_fully_parallel_save:
        return None
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1), group, False)


def save_checkpoint(
    state: RunState,
    model: list,
    optimizer: Any,
    scheduler: Any,
    checkpoint: CheckpointSection,
    run: CheckpointedRun,
    args_record: Mapping[str, Any],
    in_save: Callable[[int], None] | None = None,
    async_queue: AsyncCallsQueue | None = None,
    strategy: FullyParallelSaveStrategyWrapper | None = None,
) -> str:
    """Save ``state.iteration`` atomically under ``checkpoint.save``; returns the checkpoint directory.

    ``checkpoint`` says where and what (optimizer, RNG, format); ``run`` what is recorded of the model and the
    optimizer. The common state carries Megatron-LM's fields (``args``, ``checkpoint_version``, ``iteration``,
    ``num_floating_point_operations_so_far``, its RNG keys, content metadata) beside this trainer's, so
    Megatron-LM's pretrain_gpt.py resumes it too (checkpoint_format.py). ``args_record``: every flag and derived
    value by its Megatron-LM name (``Settings.values()``), read for nothing but the checkpoint's ``args`` record,
    which Megatron-LM's format stores whole and its loader compares with its run's. ``in_save(iteration)`` runs
    on every rank once the files are written (the fault tests' seam).

    With ``async_queue`` (--async-save, torch_dist) the shards are written by megatron-core's async
    writer while training goes on; publishing (the rename and the tracker) is the request's last
    finalize step, which megatron-core runs on every rank once every rank's write has finished.

    ``strategy``: the torch_dist save strategy (``save_strategy``); None, megatron-core's default."""
    root, iteration = checkpoint.save, state.iteration
    final = checkpoint_dir(root, iteration)
    partial = final + ".partial"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a save killed earlier
        os.makedirs(partial)
    dist.barrier()
    optim, rng = not checkpoint.no_save_optim and optimizer is not None, not checkpoint.no_save_rng
    dtensor = checkpoint.ckpt_format == fsdp.MEGATRON_FSDP_FORMAT
    metadata = dict(fsdp.FSDP_DTENSOR_METADATA) if dtensor else content_metadata(run.distributed_optimizer)
    layout = _layout()
    common = dict(
        # Megatron-LM's fields
        args=megatron_args(args_record, state, layout, no_save_optim=not optim, no_save_rng=not rng),
        checkpoint_version=CHECKPOINT_VERSION,
        iteration=iteration,
        num_floating_point_operations_so_far=state.floating_point_operations_so_far,
        # this trainer's
        run_state=state.state_dict(),
        layout=layout,
        model_shape=dict(run.model_shape),
        has_optimizer=optim,
        distributed_optimizer=run.distributed_optimizer,
        has_rng=rng,
    )
    if dtensor:  # Megatron-FSDP: torch.distributed.checkpoint over DTensors, as Megatron-LM (fsdp.py)
        common["content_metadata"] = metadata
        rng_state = _rng_state() if rng else None
        fsdp.save_checkpoint(partial, model, optimizer, scheduler, common, optim=optim, rng=rng_state)
    else:
        sharded = _sharded_state(model, optimizer, scheduler, optim=optim, metadata=metadata, loading=False)
        if rng:
            sharded["rng_state"] = _rng_object(per_dp_rank=run.rng_per_dp_rank, by_dp=layout.get("ep", 1) > 1)
        sharded.update(common)
        request = dist_checkpointing.save(
            sharded,
            partial,
            sharded_strategy=strategy,
            content_metadata=metadata,
            async_sharded_save=async_queue is not None,
        )
    finish = functools.partial(_finish_save, root, partial, final, iteration, in_save)
    if async_queue is None:
        finish()
        return final
    request.add_finalize_fn(finish)  # after megatron-core's own (the global .metadata)
    async_queue.schedule_async_request(request)
    print_rank_0(f"  scheduled an asynchronous checkpoint save of iteration {iteration:7d} to {root}")
    return final


def start_save_service() -> None:
    """Every rank at start-up, when it will save torch_dist: start the process megatron-core's checkpoint writers
    report their results through (a ``multiprocessing`` Manager, spawned, so it imports the training script again).

    megatron-core starts it at the first save that has data to write (a synchronous save runs the same async
    writer), inside that save's blocking part: 3.96 of the first --async-save's 4.36 s stall (profiled on
    benchmarks/async_save.py's model). Started here, from the main thread (its parent-death signal follows the
    thread that starts it: megatron_npu/lifetime.py), every save finds it running. The getter is private before
    megatron-core 0.17 (compat); Megatron-LM's own async_utils reads the same module's global.

    The Manager is started with SIGTERM ignored (a disposition kept across spawn's exec): a preemption's SIGTERM,
    which torchrun sends to each rank's whole process group, would otherwise end it before the rank's
    --exit-signal-handler save, which needs it. It still ends with its rank (its parent-death signal is SIGKILL)."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        checkpoint_write_results_queue()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _finish_save(root: str, partial: str, final: str, iteration: int, in_save: Callable[[int], None] | None) -> None:
    """Every rank, once every rank's files are written: publish the save."""
    if in_save is not None:
        in_save(iteration)
    dist.barrier()
    if dist.get_rank() == 0:
        _publish(root, partial, final, iteration)
    dist.barrier()
    print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {root}")


def _publish(root: str, partial: str, final: str, iteration: int) -> None:
    """Make the finished save visible: rename the directory, then swap the tracker file."""
    old = final + ".old"
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(partial, final)
    shutil.rmtree(old, ignore_errors=True)
    tracker_tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tracker_tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker_tmp, os.path.join(root, TRACKER))
    directory = os.open(root, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def clean_unfinished_saves(root: str) -> None:
    """Every rank, before loading: rank 0 removes what a save stopped before it was published
    left under ``root``, saying so. ``ITER.partial`` was never published (the tracker names an
    older checkpoint). ``ITER.old`` is the previous copy of an iteration saved again: if the
    stop came between moving it aside and publishing the new copy, it is put back."""
    if dist.get_rank() == 0 and os.path.isdir(root):
        _clean_unfinished_saves(root)
    dist.barrier()  # a restored directory is in place before any rank loads it


def _clean_unfinished_saves(root: str) -> None:
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not (name.startswith("iter_") and name.endswith((".partial", ".old")) and os.path.isdir(path)):
            continue
        final = path.rsplit(".", 1)[0]
        if name.endswith(".old") and not os.path.exists(final):
            os.rename(path, final)
            print_rank_0(f"  restored {final} from {name}: a save of the same iteration was stopped")
            continue
        shutil.rmtree(path)
        what = "an unfinished checkpoint save" if name.endswith(".partial") else "the replaced copy of a re-saved one"
        print_rank_0(f"  removed {path}: {what} (the job stopped while saving)")


def load_strategy(fully_parallel: bool) -> FullyParallelLoadStrategyWrapper | None:
    """The torch_dist load strategy of Megatron-LM's load: under --ckpt-fully-parallel-load megatron-core's
    ``FullyParallelLoadStrategyWrapper`` over the DP x CP group (each rank reads its part of what is replicated
    over DP, then the ranks exchange it); else None (megatron-core's default: every rank reads all it needs)."""
    if not fully_parallel:
        return None
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), group)


def load_checkpoint(
    model: list, optimizer: Any, scheduler: Any, checkpoint: CheckpointSection, run: CheckpointedRun
) -> RunState:
    """Load ``checkpoint.load`` (latest iteration, or ``--ckpt-step``) into the model, optimizer, scheduler
    and RNG: a checkpoint of this trainer or of Megatron-LM's, checked against ``run`` (the model's shape,
    the optimizer's kind). Returns the run's restored counters (a fresh RunState for ``--finetune`` or no
    checkpoint); the settings are not written. --ckpt-fully-parallel-load: torch_dist checkpoints only."""
    root = checkpoint.load
    iteration = checkpoint.ckpt_step if checkpoint.ckpt_step is not None else read_tracker(root)
    if iteration is None:
        if checkpoint.exit_on_missing_checkpoint:
            raise ConfigError(f"--load {root}: no {TRACKER} (and --exit-on-missing-checkpoint is set)")
        print_rank_0(f"WARNING: could not find {TRACKER} in {root}: training from scratch")
        return RunState()
    directory = checkpoint_dir(root, iteration)
    if not os.path.isdir(directory):
        raise ConfigError(
            f"--load {root}: no checkpoint directory {os.path.basename(directory)}"
            + (" (--ckpt-step)" if checkpoint.ckpt_step is not None else f" (named by {TRACKER})")
        )
    dtensor = fsdp.is_fsdp_dtensor_checkpoint(directory)
    common = fsdp.read_common(directory) if dtensor else dist_checkpointing.load_common_state_dict(directory)
    saved = _read_saved_run(common, directory)
    _check_model_shape(saved.model_shape, run.model_shape, directory)
    load_optim, load_rng = _what_to_load(saved, checkpoint, run, directory)
    if checkpoint.ckpt_fully_parallel_load and load_optim and saved.optimizer_sharding == "dp_zero_gather_scatter":
        raise ConfigError(  # as Megatron-LM's load_checkpoint: megatron-core cannot spread this format's load
            f"checkpoint {directory}: fully parallel load is not supported for dp_zero_gather_scatter "
            "checkpoints: remove --ckpt-fully-parallel-load"
        )
    if dtensor != (checkpoint.ckpt_format == fsdp.MEGATRON_FSDP_FORMAT):
        raise ConfigError(
            f"checkpoint {directory} is {'fsdp_dtensor' if dtensor else 'torch_dist'}: load it with "
            + ("--use-megatron-fsdp --ckpt-format fsdp_dtensor" if dtensor else "--ckpt-format torch_dist")
        )
    if dtensor:
        rng = _rng_state() if load_rng else None
        loaded = fsdp.load_checkpoint(directory, model, optimizer, scheduler, optim=load_optim, rng=rng)
    else:
        loaded = _load_dist_checkpoint(
            model, optimizer, scheduler, checkpoint, run, directory, saved, load_optim, load_rng
        )
    if load_optim:
        _load_optimizer(loaded, common, optimizer, scheduler, directory)
    if load_rng:
        _restore_rng(loaded["rng_state"], saved.rng_per_dp_rank)
    if checkpoint.finetune:
        print_rank_0(f"  loaded model weights from {directory} for finetuning (iteration 0)")
        return RunState()
    state = RunState()
    state.load_state_dict(saved.run_state)
    print_rank_0(
        f"  successfully loaded checkpoint from {root} at iteration {state.iteration}"
        + ("" if saved.written_by == "megatron-npu" else f" (written by {saved.written_by})")
        + f": {state.consumed_train_samples} samples consumed"
    )
    return state


def _load_dist_checkpoint(
    model: list,
    optimizer: Any,
    scheduler: Any,
    checkpoint: CheckpointSection,
    run: CheckpointedRun,
    directory: str,
    saved: SavedRun,
    load_optim: bool,
    load_rng: bool,
) -> dict[str, Any]:
    """dist-checkpointing's load into the model (--ckpt-fully-parallel-load's strategy, --dist-ckpt-strictness);
    the optimizer and RNG state returned for the caller."""
    sharded = _sharded_state(
        model, optimizer, scheduler, optim=load_optim, metadata=saved.loading_metadata(), loading=True
    )
    if load_rng:  # the saved objects' sharding; their contents are replaced by the load
        sharded["rng_state"] = _rng_object(per_dp_rank=False, by_dp=saved.rng_by_dp)
    strategy = load_strategy(checkpoint.ckpt_fully_parallel_load)
    loaded = dist_checkpointing.load(
        sharded, directory, sharded_strategy=strategy, strict=checkpoint.dist_ckpt_strictness
    )
    for key, chunk in zip(_model_keys(model), model, strict=True):
        # FSDP2: the load wrote into the parameters' own shards; its wrapper's load_state_dict is the no-op
        # Megatron-LM calls (the module's would want whole DTensors)
        (chunk if run.torch_fsdp2 else unwrap_model(chunk)).load_state_dict(loaded[key])
    return loaded


def _read_saved_run(common: dict[str, Any], directory: str) -> SavedRun:
    try:
        return SavedRun.read(common, dist_checkpointing.load_content_metadata(preloaded_state_dict=common))
    except ValueError as error:
        raise ConfigError(f"checkpoint {directory}: {error}: not a checkpoint of a GPT trainer") from None


def _what_to_load(
    saved: SavedRun, checkpoint: CheckpointSection, run: CheckpointedRun, directory: str
) -> tuple[bool, bool]:
    """(optimizer and scheduler, RNG): what of the checkpoint this run takes."""
    current = _layout()
    same_grid = _without_dp(saved.layout) == _without_dp(current)
    load_optim = saved.has_optimizer and not checkpoint.no_load_optim and not checkpoint.finetune
    # RNG states belong to one rank of one layout; sharded by DP too (EP > 1), the DP size must match
    same_ranks = same_grid and (not saved.rng_by_dp or saved.layout.get("dp") == current["dp"])
    load_rng = saved.has_rng and not checkpoint.no_load_rng and not checkpoint.finetune and same_ranks
    saved_dist_opt = saved.distributed_optimizer
    if saved_dist_opt is None:
        saved_dist_opt = run.distributed_optimizer
    if load_optim and bool(saved_dist_opt) != run.distributed_optimizer:
        given = "--use-distributed-optimizer" if saved_dist_opt else "no --use-distributed-optimizer"
        raise ConfigError(
            f"checkpoint {directory} holds {'distributed ' if saved_dist_opt else ''}optimizer state "
            f"saved with {given}: train with the same setting, or pass --no-load-optim"
        )
    resharding = saved.optimizer_sharding not in fully_reshardable_optimizer_formats()
    if load_optim and saved_dist_opt and not same_grid and resharding:
        raise ConfigError(
            f"checkpoint {directory} ({saved.written_by}) holds distributed-optimizer state sharded "
            f"{saved.optimizer_sharding!r}, which loads only under its own layout {saved.layout}: "
            "train under that layout, pass --no-load-optim, or save it with Megatron-LM's "
            "--dist-ckpt-optim-fully-reshardable"
        )
    if not same_grid:
        print_rank_0(f"  loading a {saved.layout} checkpoint into {current}: resharding; RNG states start fresh")
    return load_optim, load_rng


def _without_dp(layout: dict[str, int | None]) -> dict[str, int | None]:
    return {key: value for key, value in layout.items() if key != "dp"}


def _load_optimizer(loaded: dict, common: dict, optimizer: Any, scheduler: Any, directory: str) -> None:
    saved = saved_optimizer_count(common.get("optimizer"))  # MoE: 1 under EP1, 2 under EP > 1
    optimizer.load_state_dict(adapt_optimizer_state(loaded["optimizer"], optimizer, saved))
    fsdp.optimizer_state_as_dtensors(optimizer)  # FSDP2's parameters are DTensors; the loaded state is local
    try:
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    except AssertionError as error:  # megatron-core asserts on a changed schedule; say which flags
        raise ConfigError(
            f"checkpoint {directory}: the learning-rate schedule differs ({error}); pass the "
            "schedule flags it was saved with (--train-iters, --lr, --min-lr, --lr-decay-*, "
            "--lr-warmup-*), or --use-checkpoint-opt-param-scheduler to keep its schedule, "
            "or --override-opt-param-scheduler to take yours"
        ) from None


def _restore_rng(loaded: Any, per_dp_rank: bool) -> None:
    """Megatron-LM's choice of entry: this DP rank's under --data-parallel-random-init, else the first."""
    if not isinstance(loaded, list):
        _set_rng_state(loaded)
        return
    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    _set_rng_state(loaded[dp_rank] if per_dp_rank and dp_rank < len(loaded) else loaded[0])


def _check_model_shape(saved: dict[str, Any], current: dict[str, Any], directory: str) -> None:
    """The saved model's shape (MODEL_SHAPE_ARGS, as far as the checkpoint records them) against this run's."""
    wrong = [
        f"--{name.replace('_', '-')} {saved[name]} (given: {current.get(name)})"
        for name in MODEL_SHAPE_ARGS
        if name in saved and saved[name] != current.get(name)
    ]
    if wrong:
        raise ConfigError(f"checkpoint {directory} was saved with a different model: " + ", ".join(wrong))
