"""The common part of a checkpoint, in the fields both trainers read.

Megatron-LM core_v0.16.1 (megatron/training/checkpointing.py) saves ``args`` (its argument
namespace, from which a resume takes ``consumed_train_samples`` / ``consumed_valid_samples`` and the
saved TP / PP sizes), ``checkpoint_version`` 3.0, ``iteration``, ``num_floating_point_operations_so_far``,
``rng_state`` (a ShardedObject of per-rank dicts: ``random_rng_state``, ``np_rng_state``,
``torch_rng_state``, ``cuda_rng_state``, ``rng_tracker_states``) and the dist-checkpointing content
metadata (the distributed optimizer's sharding type). This trainer writes all of them, with its own
keys beside (``layout``, ``model_shape``, ``run_state``, ...), and reads a checkpoint of either trainer
through ``SavedRun``: a run moves between this pretrain_gpt.py and Megatron-LM's with its data position,
RNG and optimizer state.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from megatron_npu.training.run_state import RunState
from megatron_npu.training.sections import DistributedSection, FsdpSection, InitSection, ModelSection

CHECKPOINT_VERSION = 3.0  # Megatron-LM's generate_state_dict; < 2.0 makes its loader reorder QKV
# Megatron-LM's per-rank RNG keys, by the names this trainer saved them under before it wrote Megatron-LM's.
RNG_KEYS = {
    "random": "random_rng_state",
    "numpy": "np_rng_state",
    "torch": "torch_rng_state",
    "device": "cuda_rng_state",
    "tracker": "rng_tracker_states",
}
FULLY_RESHARDABLE = "fully_reshardable"
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
# Megatron-LM's names of the layout degrees, by this trainer's layout keys.
LAYOUT_ARGS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "vpp": "virtual_pipeline_model_parallel_size",
    "dp": "data_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
}
# Per-process values: the common state is the same on every rank (dist-checkpointing compares it).
_PER_RANK = ("rank", "local_rank")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def content_metadata(distributed_optimizer: bool) -> dict[str, Any]:
    """What Megatron-LM's ``_build_sharded_state_dict_metadata`` gives for this trainer's saves (less
    the process group): its loader picks the optimizer's sharding type from it. The distributed
    optimizer is always saved fully reshardable (as upstream's ``--dist-ckpt-optim-fully-reshardable``)."""
    metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if distributed_optimizer:
        metadata |= {
            "distrib_optim_sharding_type": FULLY_RESHARDABLE,
            "distrib_optim_fully_reshardable_mem_efficient": False,
        }
    return metadata


def _portable(value: Any) -> bool:
    """Whether ``value`` unpickles under torch.load(weights_only=True) in any process: plain values
    and torch dtypes (megatron-core's safe globals add Namespace, not this project's classes)."""
    if value is None or isinstance(value, bool | int | float | str | torch.dtype):
        return True
    if isinstance(value, list | tuple):
        return all(_portable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _portable(v) for k, v in value.items())
    return False


def megatron_args(
    record: Mapping[str, Any], state: RunState, layout: dict[str, int | None], **saved: bool
) -> argparse.Namespace:
    """The ``args`` Megatron-LM saves and reads back: ``record``, every flag and derived value of the run by
    its Megatron-LM name in the settings' order (``Settings.values()``; per-process values left out), the degrees
    of the layout that saved, and the run's counters. A new namespace: the record is not touched. ``saved``: what this checkpoint
    holds (``no_save_optim``, ``no_save_rng``), as Megatron-LM's loader asks its saved args."""
    values = {name: value for name, value in record.items() if _recorded(name) and _portable(value)}
    if isinstance(values.get("params_dtype"), str):  # Megatron-LM's args hold the torch dtype
        values["params_dtype"] = _DTYPES.get(values["params_dtype"], values["params_dtype"])
    values |= {LAYOUT_ARGS[key]: degree for key, degree in layout.items()}
    values |= {"expert_tensor_parallel_size": layout.get("etp", layout["tp"])}
    values |= {"expert_model_parallel_size": layout.get("ep", 1)}
    values |= {"world_size": layout["tp"] * layout["pp"] * layout["dp"], "ckpt_format": "torch_dist"}
    values |= {"use_dist_ckpt": True, "iteration": state.iteration, "skipped_train_samples": 0}
    values |= {
        "consumed_train_samples": state.consumed_train_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
    }
    values |= saved
    return argparse.Namespace(**values)


def _recorded(name: str) -> bool:
    return not name.startswith("_") and name not in _PER_RANK


def megatron_rng(state: dict[str, Any]) -> dict[str, Any]:
    """One rank's saved RNG states under Megatron-LM's keys, whichever trainer saved them."""
    return {RNG_KEYS.get(key, key): value for key, value in state.items()}


@dataclasses.dataclass
class SavedRun:
    """What a checkpoint's common state says, whichever trainer wrote it."""

    layout: dict[str, int | None]
    model_shape: dict[str, Any]
    has_optimizer: bool
    distributed_optimizer: bool | None  # None: not recorded
    has_rng: bool
    metadata: dict[str, Any]  # dist-checkpointing content metadata: the optimizer's sharding type
    run_state: dict[str, Any]
    rng_per_dp_rank: bool  # Megatron-LM's --data-parallel-random-init: one RNG entry per DP rank
    rng_by_dp: bool  # the RNG objects are sharded by DP rank too (Megatron-LM's, under EP > 1)
    written_by: str  # "megatron-npu", "Megatron-LM" or "megatron-npu (before Megatron-LM's fields)"

    @classmethod
    def read(cls, common: dict[str, Any], metadata: dict[str, Any] | None) -> SavedRun:
        args = common.get("args")
        if "layout" in common:  # this trainer's own keys, with or without Megatron-LM's beside
            return cls._own(common, metadata, args)
        if args is None:
            raise ValueError("neither this trainer's layout nor Megatron-LM's args in the checkpoint")
        return cls._megatron_lm(common, metadata, args)

    @classmethod
    def _own(cls, common: dict[str, Any], metadata: dict[str, Any] | None, args: Any) -> SavedRun:
        distributed = common.get("distributed_optimizer")
        if metadata is None:  # saved before the content metadata was written: always fully reshardable
            metadata = content_metadata(bool(distributed))
        run_state = common.get("run_state") or {
            "iteration": common.get("iteration", 0),
            "consumed_train_samples": common.get("consumed_train_samples", 0),
            "consumed_valid_samples": common.get("consumed_valid_samples", 0),
        }
        return cls(
            layout=common["layout"],
            model_shape=common.get("model_shape", {}),
            has_optimizer=common.get("has_optimizer", False),
            distributed_optimizer=distributed,
            has_rng=common.get("has_rng", False),
            metadata=metadata,
            run_state=run_state,
            rng_per_dp_rank=bool(getattr(args, "data_parallel_random_init", False)),
            rng_by_dp=args is not None and common["layout"].get("ep", 1) > 1,
            written_by="megatron-npu" if args is not None else "megatron-npu (before Megatron-LM's fields)",
        )

    @classmethod
    def _megatron_lm(cls, common: dict[str, Any], metadata: dict[str, Any] | None, args: Any) -> SavedRun:
        layout = {key: getattr(args, name, None) for key, name in LAYOUT_ARGS.items()}
        layout = {key: 1 if value is None and key != "vpp" else value for key, value in layout.items()}
        if layout["ep"] == 1 and layout["etp"] == layout["tp"]:  # this trainer records the experts' grid only
            del layout["ep"], layout["etp"]  # where it differs from the dense one
        run_state = {
            "iteration": common.get("iteration", 0),
            "consumed_train_samples": getattr(args, "consumed_train_samples", 0),
            "consumed_valid_samples": getattr(args, "consumed_valid_samples", 0),
            "floating_point_operations_so_far": common.get("num_floating_point_operations_so_far", 0),
        }
        model_shape = {name: getattr(args, name) for name in MODEL_SHAPE_ARGS if hasattr(args, name)}
        if not getattr(args, "group_query_attention", False):  # Megatron-LM leaves its default (1) then
            model_shape["num_query_groups"] = args.num_attention_heads
        return cls(
            layout=layout,
            model_shape=model_shape,
            has_optimizer=not getattr(args, "no_save_optim", False),
            distributed_optimizer=getattr(args, "use_distributed_optimizer", None),
            has_rng=not getattr(args, "no_save_rng", False),
            # Megatron-LM before content metadata (megatron-core < 0.13) saved its own optimizer formats
            metadata=metadata or {"distrib_optim_sharding_type": "dp_zero_gather_scatter"},
            run_state=run_state,
            rng_per_dp_rank=bool(getattr(args, "data_parallel_random_init", False)),
            rng_by_dp=(getattr(args, "expert_model_parallel_size", 1) or 1) > 1,
            written_by="Megatron-LM",
        )

    @property
    def optimizer_sharding(self) -> str | None:
        """The distributed optimizer's sharding type (None: no distributed optimizer state)."""
        return self.metadata.get("distrib_optim_sharding_type")

    def loading_metadata(self) -> dict[str, Any]:
        """The sharded-state-dict metadata to load this checkpoint's optimizer with: the saved one."""
        return content_metadata(bool(self.distributed_optimizer)) | self.metadata


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointedRun:
    """What a save records of this run and a load checks and reads it by, beyond the checkpoint section: from the
    model, tokenizer, distributed, init and FSDP sections (``from_sections``); the counterpart of ``SavedRun``."""

    model_shape: dict[str, Any]  # MODEL_SHAPE_ARGS by name: the shapes of the saved tensors
    distributed_optimizer: bool  # --use-distributed-optimizer: the optimizer state's kind
    rng_per_dp_rank: bool  # --data-parallel-random-init: the RNG states of every DP rank are saved
    torch_fsdp2: bool = False  # --use-torch-fsdp2: a load writes into the wrapper's own shards

    @classmethod
    def from_sections(
        cls,
        model: ModelSection,
        distributed: DistributedSection,
        init: InitSection,
        fsdp: FsdpSection,
        *,
        padded_vocab_size: int | None,
    ) -> CheckpointedRun:
        """``padded_vocab_size``: the model's vocabulary, which the tokenizer gives once the settings are parsed."""
        shape = {
            name: padded_vocab_size if name == "padded_vocab_size" else getattr(model, name)
            for name in MODEL_SHAPE_ARGS
        }
        return cls(
            model_shape=shape,
            distributed_optimizer=bool(distributed.use_distributed_optimizer),
            rng_per_dp_rank=bool(init.data_parallel_random_init),
            torch_fsdp2=bool(fsdp.use_torch_fsdp2),
        )
