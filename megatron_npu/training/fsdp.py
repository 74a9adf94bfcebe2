"""FSDP in this trainer, as Megatron-LM core_v0.16.1 builds it (training.get_model): the model
chunks wrapped in megatron-core's Megatron-FSDP adapter (``--use-megatron-fsdp``) or its torch
FSDP2 wrapper (``--use-torch-fsdp2``) instead of its DDP, then the optimizer megatron-core builds
over them. What either needs off CUDA (DeviceMesh device type, PREMUL_SUM, ...) is patched by
capability in megatron_npu/patches/fsdp.py; the flags and their rules are in fsdp_args.py.

Checkpoints: Megatron-FSDP's are ``--ckpt-format fsdp_dtensor`` (torch.distributed.checkpoint
over the DTensor state dicts: ``save_checkpoint`` / ``load_checkpoint`` here, called by
checkpointing.py inside its atomic save). FSDP2's are ``torch_dist``, loaded in place into its shards
(``optimizer_state_as_dtensors`` puts the optimizer state back in DTensors).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig

from megatron_npu.training.fsdp_args import MEGATRON_FSDP_FORMAT
from megatron_npu.training.sections import FsdpSection

__all__ = [
    "MEGATRON_FSDP_FORMAT",
    "wrap",
    "save_checkpoint",
    "load_checkpoint",
    "read_common",
    "optimizer_state_as_dtensors",
]

# Megatron-LM's optimizer content metadata for Megatron-FSDP checkpoints (its
# _build_sharded_state_dict_metadata under --ckpt-format fsdp_dtensor)
FSDP_DTENSOR_METADATA = {"distrib_optim_sharding_type": "fsdp_dtensor"}


def wrap_megatron_fsdp(chunks: list, config: Any, ddp: DistributedDataParallelConfig, device: torch.device) -> list:
    """Each chunk in Megatron-FSDP: its TransformerLayers are the units whose weights are
    gathered just in time (optim_grads_params); parameters, gradients and optimizer state are
    sharded over the data-parallel group as ``--data-parallel-sharding-strategy`` says."""
    # imported here: megatron-core 0.12/0.13 (supported releases, tests/releases) have no Megatron-FSDP
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    return [
        FullyShardedDataParallel(config=config, ddp_config=ddp, module=chunk, disable_bucketing=i > 0, device=device)
        for i, chunk in enumerate(chunks)
    ]


def wrap_torch_fsdp2(chunks: list, config: Any, section: FsdpSection) -> list:
    """Each chunk under torch's ``fully_shard`` (its layers and embeddings, then the whole chunk)."""
    from megatron.core.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig  # 0.13+

    fsdp2_config = TorchFullyShardedDataParallelConfig(reshard_after_forward=section.torch_fsdp2_reshard_after_forward)
    return [
        TorchFullyShardedDataParallel(config=config, ddp_config=fsdp2_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def wrap(
    chunks: list, config: Any, ddp: DistributedDataParallelConfig, section: FsdpSection, device: torch.device
) -> list:
    """The chunks in the FSDP implementation the section names (``ddp``: Megatron-FSDP's config)."""
    if section.use_megatron_fsdp:
        return wrap_megatron_fsdp(chunks, config, ddp, device)
    return wrap_torch_fsdp2(chunks, config, section)


def fsdp_dtensor_state(model: list, optimizer: Any, scheduler: Any, *, optim: bool, loading: bool) -> dict[str, Any]:
    """The model and optimizer state Megatron-LM writes as ``fsdp_dtensor``: each chunk's state
    dict of DTensors, the distributed optimizer's DTensor state, the scheduler; prepared by
    megatron-core's own helpers as Megatron-LM's ``preprocess_fsdp_dtensor_state_dict`` does (modules'
    ``_extra_state`` dropped, SwiGLU's fused fc1 split in two, uneven DTensor shards described)."""
    (chunk,) = model  # Megatron-FSDP runs without pipeline stages here (fsdp_args.py)
    state = _unprepared_state(chunk, optimizer, scheduler, optim=optim, loading=loading)
    return _prepared_for_dcp(chunk, state)


def _unprepared_state(chunk: Any, optimizer: Any, scheduler: Any, *, optim: bool, loading: bool) -> dict[str, Any]:
    """The model's and optimizer's state dicts before fsdp_dtensor's renaming and splitting."""
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_fp8_extra_state_case

    state: dict[str, Any] = {"model": chunk.state_dict_for_save_checkpoint()}
    handle_fp8_extra_state_case(state["model"])  # Megatron-LM keeps no ``_extra_state`` in this format
    if optim:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading, metadata=FSDP_DTENSOR_METADATA)
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def _prepared_for_dcp(chunk: Any, state: dict[str, Any]) -> dict[str, Any]:
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer.fsdp_dtensor_checkpoint import (
        handle_experts_in_state_dict,
        handle_swiglu_in_state_dict,
    )

    if chunk.config.gated_linear_unit:
        state["model"], optim_state = handle_swiglu_in_state_dict(chunk, state["model"], state.get("optimizer"))
        if optim_state is not None:
            state["optimizer"] = optim_state
    # each EP rank's local experts under their global index (the optimizer state is named so already)
    state["model"] = handle_experts_in_state_dict(state["model"], chunk.config.num_moe_experts)
    preprocess_state_dict_for_uneven_dtensor(state)
    return state


# ---- fsdp_dtensor files ------------------------------------------------------------------------
#: this trainer's common state (checkpointing.py's fields, Megatron-LM's among them), written by rank 0
#: beside torch.distributed.checkpoint's files: read before the state to load is built
COMMON_FILE = "common.pt"
#: the common fields Megatron-LM's fsdp_dtensor loader reads from the DCP state itself
MEGATRON_LM_KEYS = ("args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far")


def is_fsdp_dtensor_checkpoint(directory: str) -> bool:
    """torch.distributed.checkpoint's ``.metadata`` without dist-checkpointing's ``metadata.json``."""
    return os.path.isfile(os.path.join(directory, ".metadata")) and not os.path.isfile(
        os.path.join(directory, "metadata.json")
    )


def _rng_entry(rng_state: dict[str, Any]) -> dict[str, list]:
    """Megatron-LM's fsdp_dtensor RNG entry: this (PP, TP) rank's states, replicated over DP."""
    pp, tp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    return {f"({pp}, {tp})": [rng_state]}


def save_checkpoint(
    directory: str, model: list, optimizer: Any, scheduler: Any, common: dict[str, Any], *, optim: bool, rng: Any
) -> None:
    """Every rank writes its shards of ``directory`` (torch.distributed.checkpoint); rank 0 the common state."""
    state = fsdp_dtensor_state(model, optimizer, scheduler, optim=optim, loading=False)
    if rng is not None:
        state["rng_state"] = _rng_entry(rng)
    state.update({key: common[key] for key in MEGATRON_LM_KEYS})
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory))
    if dist.get_rank() == 0:
        torch.save(common, os.path.join(directory, COMMON_FILE))


def read_common(directory: str) -> dict[str, Any]:
    """This trainer's common state; for Megatron-LM's own checkpoint (no ``common.pt``), its common fields,
    which it keeps inside the DCP state (read here by this rank alone, no collective)."""
    path = os.path.join(directory, COMMON_FILE)
    if os.path.isfile(path):
        return torch.load(path, weights_only=False)
    state: dict[str, Any] = dict.fromkeys(MEGATRON_LM_KEYS)
    dcp.load(state, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
    return state


def load_checkpoint(
    directory: str, model: list, optimizer: Any, scheduler: Any, *, optim: bool, rng: Any
) -> dict[str, Any]:
    """Load ``directory`` into the model and optimizer (their DTensor shards, in place, under this run's
    DP size) and return the loaded state (``optimizer``, ``opt_param_scheduler``, ``rng_state`` for the
    caller: the optimizer's param groups and the scheduler are loaded from it).
    ``rng``: this rank's current states, the structure to load the saved ones into (None: not loaded)."""
    (chunk,) = model
    unprepared = _unprepared_state(chunk, optimizer, scheduler, optim=optim, loading=True)
    # as Megatron-LM's load: the optimizer gets its own state dict back after the in-place load, not the one
    # handle_swiglu_in_state_dict split into fc1's _w / _v halves (the resumed steps drifted, rel 2e-5)
    optimizer_state = unprepared["optimizer"].copy() if optim else None
    state = _prepared_for_dcp(chunk, unprepared)
    if rng is not None:
        state["rng_state"] = _rng_entry(rng)
    # in place: the state dicts hold the parameters' and the optimizer's own DTensors
    dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    if optimizer_state is not None:
        state["optimizer"] = optimizer_state
    # the loaded (main) weights into the weights the forward gathers: what Megatron-FSDP's hook after
    # load_state_dict does (Megatron-LM triggers it through a load_state_dict that copies nothing)
    for chunk in model:
        chunk.module.install_optimized_model_weights()
    if rng is not None:
        (states,) = state["rng_state"].values()
        state["rng_state"] = states[0]
    return state


def optimizer_state_as_dtensors(optimizer: Any) -> None:
    """Each loaded optimizer state tensor of a DTensor parameter (torch FSDP2) as a DTensor laid out like it.

    dist-checkpointing loads the optimizer's state as the local shards it saved (megatron-core's
    ``make_sharded_optimizer_tensor`` takes ``to_local()`` of each), and torch's ``load_state_dict`` keeps
    them as plain tensors: Adam's first step after a resume then mixes DTensor parameters with plain
    state ("aten.lerp_ got mixed torch.Tensor and DTensor"). No-op for every other parameter."""
    from torch.distributed.tensor import DTensor

    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", inner)
        for param, state in torch_optimizer.state.items():
            if not isinstance(param, DTensor):
                continue
            for key, value in state.items():
                if torch.is_tensor(value) and not isinstance(value, DTensor) and value.shape == param.to_local().shape:
                    state[key] = DTensor.from_local(
                        value,
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
