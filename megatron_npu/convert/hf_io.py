"""Hugging Face safetensors directories: read one tensor at a time, write in shards.

safetensors' ``safe_open`` maps the file and reads only the tensor asked for, so a reader
holds one tensor, not a shard. What it lacks is the multi-file index
(``model.safetensors.index.json``) that transformers writes; that is the few lines here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_npu.convert.hf_config import ConvertError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Prefixes some checkpoints omit (the hub's gpt2 has "h.0.attn..." where save_pretrained writes "transformer.h.0...").
OPTIONAL_PREFIXES = ("transformer.", "model.")


class HFReader:
    """Tensors of a model directory by name, each read from its shard on demand."""

    def __init__(self, model_dir: str) -> None:
        index = os.path.join(model_dir, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(model_dir, SINGLE)):
            with safe_open(os.path.join(model_dir, SINGLE), framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE)
        else:
            raise ConvertError(f"{model_dir}: no {SINGLE} or {INDEX} (save the model with safetensors)")
        for shard in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(model_dir, shard)):
                raise ConvertError(f"{model_dir}: shard {shard} named by {INDEX} is missing: download it again")
        self.model_dir, self.weight_map = model_dir, weight_map

    def _name(self, name: str) -> str:
        if name in self.weight_map:
            return name
        for prefix in OPTIONAL_PREFIXES:
            if name.startswith(prefix) and name[len(prefix) :] in self.weight_map:
                return name[len(prefix) :]
        raise ConvertError(f"{self.model_dir}: no tensor {name} (the checkpoint does not match its config.json)")

    def get(self, name: str) -> torch.Tensor:
        name = self._name(name)
        with safe_open(os.path.join(self.model_dir, self.weight_map[name]), framework="pt") as f:
            return f.get_tensor(name)


class HFWriter:
    """Writes tensors into ``model-0000N-of-0000M.safetensors`` shards of about ``shard_bytes``."""

    def __init__(self, out_dir: str, shard_bytes: int = 2 << 30) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.shard_bytes = out_dir, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.files: list[list[str]] = []
        self.size = 0

    def add(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            self.pending[name] = tensor.contiguous()
            self.size += tensor.numel() * tensor.element_size()
            if self.size >= self.shard_bytes:
                self._flush()

    def _flush(self) -> None:
        if self.pending:
            path = os.path.join(self.out_dir, f"part-{len(self.files):05d}.safetensors")
            save_file(self.pending, path, metadata={"format": "pt"})
            self.files.append(list(self.pending))
            self.pending, self.size = {}, 0

    def close(self) -> None:
        """Name the shards as transformers does; one shard is ``model.safetensors``."""
        self._flush()
        total = len(self.files)
        weight_map = {}
        for i, names in enumerate(self.files):
            final = SINGLE if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, f"part-{i:05d}.safetensors"), os.path.join(self.out_dir, final))
            weight_map.update(dict.fromkeys(names, final))
        if total > 1:
            with open(os.path.join(self.out_dir, INDEX), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
