"""A ``torch_dist`` checkpoint written and read one piece (the embedding, a layer) at a time.

A save by N ranks leaves each rank's chunks in its own ``__R_K.distcp`` files and one
``.metadata`` listing every chunk: layer i of the model is the chunk at offset i of each
stacked ``decoder.layers.*`` tensor. The converter saves its pieces one after another, each
with megatron-core's own ``dist_checkpointing.save`` into a staging folder, and ``merge``
makes them one checkpoint, as if each piece had been a rank. One wrinkle: megatron-core
describes a one-process save as owning the whole grid of each tensor, so a piece saves its
layers as stacks of one (offset 0) and ``merge`` moves each chunk to its layer. Reading a
layer back is the same in reverse: torch's reader is given a view of ``.metadata`` in which
that layer's chunks (of any TP x PP layout) form stacks of one.
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from dataclasses import replace

import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

METADATA = ".metadata"
Place = tuple[tuple[int, ...], tuple[int, ...]]  # (global shape, offset on the layer axis)


class Pieces:
    """Pieces saved under ``staging/N``; ``merge(directory)`` moves them into a checkpoint."""

    def __init__(self, staging: str) -> None:
        shutil.rmtree(staging, ignore_errors=True)  # a conversion stopped earlier
        os.makedirs(staging)
        self.staging = staging
        self.places: list[dict[str, Place]] = []  # per piece: where its stacks of one belong

    def save(self, sharded_state_dict: dict) -> None:
        """One piece: a part of the model's sharded state dict, saved as its own checkpoint."""
        places: dict[str, Place] = {}

        def stack_of_one(entry: object) -> object:
            # the layer axis only: a piece holds all of its layer's experts (the expert axis, whole)
            if not isinstance(entry, ShardedTensor) or not layer_stacked(entry.key):
                return entry
            places[entry.key] = (entry.global_shape, entry.global_offset[:1])
            return replace(
                entry,
                global_shape=(1, *entry.global_shape[1:]),
                global_offset=(0, *entry.global_offset[1:]),
                axis_fragmentations=(1, *entry.axis_fragmentations[1:]),
            )

        apply_factories(sharded_state_dict)  # SwiGLU's fc1: its two halves, as ShardedTensors
        dict_list_map_inplace(stack_of_one, sharded_state_dict)
        self.places.append(places)
        directory = os.path.join(self.staging, str(len(self.places)))
        os.makedirs(directory)
        # Integrity is a property of the whole checkpoint, checked by the last piece's save and by loading.
        dist_checkpointing.save(sharded_state_dict, directory, validate_access_integrity=False)

    def merge(self, directory: str) -> None:
        """Move every piece's files into ``directory`` (a finished save of rank 0's files) as
        ranks 1..N's, and write one ``.metadata`` with all their chunks in place."""
        merged = _read_metadata(directory)
        for n, places in enumerate(self.places, 1):
            piece = os.path.join(self.staging, str(n))
            metadata = _read_metadata(piece)
            renamed = {}
            for name in os.listdir(piece):
                if name.endswith(".distcp"):  # __0_K.distcp: rank 0's K-th file
                    renamed[name] = f"__{n}_{name.rsplit('_', 1)[1]}"
                    os.replace(os.path.join(piece, name), os.path.join(directory, renamed[name]))
            for fqn, entry in metadata.state_dict_metadata.items():
                if fqn in places:
                    shape, at = places[fqn]
                    chunks = [replace(c, offsets=_moved(c.offsets, at)) for c in entry.chunks]
                    entry = replace(entry, size=torch.Size(shape), chunks=chunks)
                have = merged.state_dict_metadata.get(fqn)
                if isinstance(entry, TensorStorageMetadata) and have is not None:
                    if (have.size, have.properties.dtype) != (entry.size, entry.properties.dtype):
                        raise RuntimeError(f"{fqn}: pieces disagree on its global shape or dtype")
                    have.chunks.extend(entry.chunks)
                else:
                    merged.state_dict_metadata[fqn] = entry
            for index, info in metadata.storage_data.items():
                if index.fqn in places:
                    index = MetadataIndex(index.fqn, _moved(index.offset, places[index.fqn][1]))
                merged.storage_data[index] = replace(info, relative_path=renamed[info.relative_path])
        with open(os.path.join(directory, METADATA + ".tmp"), "wb") as f:
            pickle.dump(merged, f)
        os.replace(os.path.join(directory, METADATA + ".tmp"), os.path.join(directory, METADATA))
        shutil.rmtree(self.staging)


def layer_stacked(key: str) -> bool:
    """Whether ``key`` is one tensor of every layer on a leading layer axis: megatron-core stacks
    the layers of a homogeneous block (``decoder.layers.mlp...``); a block of dense and MoE layers
    (``--moe-layer-freq`` other than 1) keys each layer on its own (``decoder.layers.3.mlp...``)."""
    parts = key.split(".")
    return key.startswith("decoder.layers.") and not parts[2].isdigit()


def _moved(offsets: torch.Size, at: tuple[int, ...]) -> torch.Size:
    return torch.Size((*at, *offsets[len(at) :]))


def _read_metadata(directory: str) -> Metadata:
    with open(os.path.join(directory, METADATA), "rb") as f:
        return pickle.load(f)


class _LayerView(dcp.FileSystemReader):
    """A checkpoint whose stacked tensors are cut to the given layers' chunks, as stacks of one."""

    def __init__(self, directory: str, metadata: Metadata, wanted: dict[str, tuple[int, ...]]) -> None:
        super().__init__(directory)
        self.view = Metadata(state_dict_metadata={}, storage_data={})
        for fqn, at in wanted.items():
            entry = metadata.state_dict_metadata.get(fqn)
            if not isinstance(entry, TensorStorageMetadata):
                raise KeyError(f"{directory}: the checkpoint has no tensor {fqn}")
            chunks: list[ChunkStorageMetadata] = []
            for chunk in entry.chunks:
                if tuple(chunk.offsets[: len(at)]) == at:
                    index = MetadataIndex(fqn, _moved(chunk.offsets, (0,) * len(at)))
                    self.view.storage_data[index] = metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
                    chunks.append(replace(chunk, offsets=index.offset))
            self.view.state_dict_metadata[fqn] = replace(
                entry, size=torch.Size((1,) * len(at) + tuple(entry.size[len(at) :])), chunks=chunks
            )

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        return self.view


class Reader:
    """Whole tensors of a checkpoint of any layout, some layers at a time."""

    def __init__(self, directory: str) -> None:
        self.directory, self.metadata = directory, _read_metadata(directory)

    def shape(self, key: str, stacked: int) -> tuple[int, ...]:
        """The global shape of one layer of ``key`` (``stacked`` leading layer axes)."""
        if key not in self.metadata.state_dict_metadata:
            raise KeyError(f"{self.directory}: the checkpoint has no tensor {key}")
        return tuple(self.metadata.state_dict_metadata[key].size[stacked:])

    def load(self, wanted: dict[str, tuple[tuple[int, ...], torch.Tensor]]) -> None:
        """Fill each target tensor (key: (layer offset on the stacked axes, target)) in place."""
        view = _LayerView(self.directory, self.metadata, {key: at for key, (at, _) in wanted.items()})
        targets = {key: target.view((1,) * len(at) + tuple(target.shape)) for key, (at, target) in wanted.items()}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(targets, storage_reader=view, no_dist=True)
