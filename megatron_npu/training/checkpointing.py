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
states are per (PP, TP) rank and are restored only when the layout is unchanged.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.utils import unwrap_model

from megatron_npu.accelerator import get_accelerator
from megatron_npu.training.arguments import ConfigError
from megatron_npu.training.global_vars import print_rank_0
from megatron_npu.training.moe_checkpoint import adapt_optimizer_state, saved_optimizer_count

TRACKER = "latest_checkpointed_iteration.txt"
# chained_optim_avoid_prefix as Megatron-LM: MoE's dense and expert optimizers (a ChainedOptimizer under
# EP > 1) save under the same keys as one optimizer (EP1), so a checkpoint loads across EP sizes.
DIST_OPT_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
# Arguments that fix the shape of the saved tensors: a mismatch is a user error.
MODEL_SHAPE_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "padded_vocab_size",
    "normalization",
    "swiglu",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "position_embedding_type",
)


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
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device": get_accelerator().get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_accelerator().set_rng_state(state["device"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _model_keys(model: list) -> list[str]:
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def _sharded_state(model: list, optimizer: Any, scheduler: Any, *, optim: bool, rng: bool, loading: bool) -> dict:
    state: dict[str, Any] = {}
    for key, chunk in zip(_model_keys(model), model, strict=True):
        state[key] = unwrap_model(chunk).sharded_state_dict()
    if optim:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading, metadata=DIST_OPT_FORMAT)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if rng:
        state["rng_state"] = ShardedObject(
            "rng_state",
            [_rng_state()],
            (
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_tensor_model_parallel_world_size(),
            ),
            (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),
            replica_id=parallel_state.get_data_parallel_rank(),
        )
    return state


def save_checkpoint(
    iteration: int,
    model: list,
    optimizer: Any,
    scheduler: Any,
    args: argparse.Namespace,
    before_publish: Callable[[int], None] | None = None,
) -> str:
    """Save atomically under ``args.save``; returns the checkpoint directory.

    ``before_publish(iteration)`` runs on every rank once the files are written (the fault tests' seam)."""
    root = args.save
    final = checkpoint_dir(root, iteration)
    partial = final + ".partial"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a save killed earlier
        os.makedirs(partial)
    dist.barrier()
    state = _sharded_state(
        model, optimizer, scheduler, optim=not args.no_save_optim, rng=not args.no_save_rng, loading=False
    )
    state.update(
        iteration=iteration,
        consumed_train_samples=args.consumed_train_samples,
        consumed_valid_samples=args.consumed_valid_samples,
        layout=_layout(),
        model_shape={name: getattr(args, name, None) for name in MODEL_SHAPE_ARGS},
        has_optimizer=not args.no_save_optim,
        distributed_optimizer=args.use_distributed_optimizer,
        has_rng=not args.no_save_rng,
    )
    dist_checkpointing.save(state, partial)
    if before_publish is not None:
        before_publish(iteration)
    dist.barrier()
    if dist.get_rank() == 0:
        _publish(root, partial, final, iteration)
    dist.barrier()
    print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {root}")
    return final


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


def load_checkpoint(model: list, optimizer: Any, scheduler: Any, args: argparse.Namespace) -> int:
    """Load ``args.load`` (latest iteration) into the model, optimizer, scheduler and RNG.

    Returns the iteration to continue from (0 for ``--finetune`` or no checkpoint).
    """
    root = args.load
    iteration = args.ckpt_step if args.ckpt_step is not None else read_tracker(root)
    if iteration is None:
        if args.exit_on_missing_checkpoint:
            raise ConfigError(f"--load {root}: no {TRACKER} (and --exit-on-missing-checkpoint is set)")
        print_rank_0(f"WARNING: could not find {TRACKER} in {root}: training from scratch")
        return 0
    directory = checkpoint_dir(root, iteration)
    if not os.path.isdir(directory):
        raise ConfigError(
            f"--load {root}: no checkpoint directory {os.path.basename(directory)}"
            + (" (--ckpt-step)" if args.ckpt_step is not None else f" (named by {TRACKER})")
        )
    common = dist_checkpointing.load_common_state_dict(directory)
    _check_model_shape(common.get("model_shape", {}), args, directory)
    same_layout = {k: v for k, v in common["layout"].items() if k != "dp"} == {
        k: v for k, v in _layout().items() if k != "dp"
    }
    load_optim = common.get("has_optimizer", False) and not args.no_load_optim and not args.finetune
    load_rng = common.get("has_rng", False) and not args.no_load_rng and not args.finetune and same_layout
    saved_dist_opt = common.get("distributed_optimizer", args.use_distributed_optimizer)
    if load_optim and saved_dist_opt != args.use_distributed_optimizer:
        given = "--use-distributed-optimizer" if saved_dist_opt else "no --use-distributed-optimizer"
        raise ConfigError(
            f"checkpoint {directory} holds {'distributed ' if saved_dist_opt else ''}optimizer state "
            f"saved with {given}: train with the same setting, or pass --no-load-optim"
        )
    if not same_layout:
        print_rank_0(f"  loading a {common['layout']} checkpoint into {_layout()}: resharding; RNG states start fresh")
    state = _sharded_state(model, optimizer, scheduler, optim=load_optim, rng=load_rng, loading=True)
    state = dist_checkpointing.load(state, directory, strict=args.dist_ckpt_strictness)
    for key, chunk in zip(_model_keys(model), model, strict=True):
        unwrap_model(chunk).load_state_dict(state[key])
    if load_optim:
        saved = saved_optimizer_count(common.get("optimizer"))  # MoE: 1 under EP1, 2 under EP > 1
        optimizer.load_state_dict(adapt_optimizer_state(state["optimizer"], optimizer, saved))
        try:
            scheduler.load_state_dict(state["opt_param_scheduler"])
        except AssertionError as error:  # megatron-core asserts on a changed schedule; say which flags
            raise ConfigError(
                f"checkpoint {directory}: the learning-rate schedule differs ({error}); pass the "
                "schedule flags it was saved with (--train-iters, --lr, --min-lr, --lr-decay-*, "
                "--lr-warmup-*), or --use-checkpoint-opt-param-scheduler to keep its schedule, "
                "or --override-opt-param-scheduler to take yours"
            ) from None
    if load_rng:
        _set_rng_state(state["rng_state"][0] if isinstance(state["rng_state"], list) else state["rng_state"])
    if args.finetune:
        print_rank_0(f"  loaded model weights from {directory} for finetuning (iteration 0)")
        return 0
    args.consumed_train_samples = common["consumed_train_samples"]
    args.consumed_valid_samples = common["consumed_valid_samples"]
    print_rank_0(f"  successfully loaded checkpoint from {root} at iteration {iteration}")
    return iteration


def _check_model_shape(saved: dict, args: argparse.Namespace, directory: str) -> None:
    wrong = [
        f"--{name.replace('_', '-')} {saved[name]} (given: {getattr(args, name, None)})"
        for name in MODEL_SHAPE_ARGS
        if name in saved and saved[name] != getattr(args, name, None)
    ]
    if wrong:
        raise ConfigError(f"checkpoint {directory} was saved with a different model: " + ", ".join(wrong))
