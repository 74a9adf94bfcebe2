"""Hugging Face safetensors directories: read one tensor at a time, write in shards.

safetensors' ``safe_open`` maps the file and reads only the tensor asked for, so a reader
holds one tensor, not a shard. What it lacks is the multi-file index
(``model.safetensors.index.json``) that transformers writes, and a writer that does not
need a whole shard in memory (``save_file`` takes a dict of tensors); those are here.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterable
from typing import BinaryIO

import torch
from safetensors import safe_open

from megatron_npu.convert.hf_config import ConvertError
from megatron_npu.convert.mapping import sliced

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

    def has(self, name: str) -> bool:
        try:
            return bool(self._name(sliced(name)[0]))
        except ConvertError:
            return False

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype (``F32``, ``BF16``, ...), read from its shard's header."""
        name = self._name(sliced(name)[0])
        with safe_open(os.path.join(self.model_dir, self.weight_map[name]), framework="pt") as f:
            return f.get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        name, row = sliced(name)
        name = self._name(name)
        with safe_open(os.path.join(self.model_dir, self.weight_map[name]), framework="pt") as f:
            return f.get_tensor(name) if row is None else f.get_slice(name)[row : row + 1][0].clone()

    def same(self, name: str, other: str, block_rows: int = 4096) -> bool:
        """Whether two tensors have the same dtype, shape and bits, read ``block_rows`` rows at a time (an
        embedding is a whole shard's worth of memory)."""
        a, b = self._name(name), self._name(other)
        with (
            safe_open(os.path.join(self.model_dir, self.weight_map[a]), framework="pt") as fa,
            safe_open(os.path.join(self.model_dir, self.weight_map[b]), framework="pt") as fb,
        ):
            sa, sb = fa.get_slice(a), fb.get_slice(b)
            if sa.get_dtype() != sb.get_dtype() or sa.get_shape() != sb.get_shape():
                return False
            rows = sa.get_shape()[0] if sa.get_shape() else 0
            if not rows:
                return fa.get_tensor(a).view(torch.uint8).equal(fb.get_tensor(b).view(torch.uint8))
            return all(
                sa[i : i + block_rows].view(torch.uint8).equal(sb[i : i + block_rows].view(torch.uint8))
                for i in range(0, rows, block_rows)
            )


# safetensors' dtype names (its file format, which the writer below produces itself)
DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}


class HFWriter:
    """Writes tensors into ``model-0000N-of-0000M.safetensors`` shards of about ``shard_bytes``.

    Streams: each tensor's bytes go to the shard's data file as they come, and the header
    (names, shapes, offsets; safetensors puts it first) is written in front when the shard is
    full, so memory holds one tensor, not a shard."""

    def __init__(self, out_dir: str, shard_bytes: int = 2 << 30) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.shard_bytes = out_dir, shard_bytes
        self.files: list[list[str]] = []
        self.header: dict[str, dict] = {}
        self.data: BinaryIO | None = None
        self.size = 0

    def _part(self, n: int) -> str:
        return os.path.join(self.out_dir, f"part-{n:05d}.safetensors")

    def add(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            if self.data is None:
                self.data = open(self._part(len(self.files)) + ".data", "wb")
            raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
            self.header[name] = {
                "dtype": DTYPES[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [self.size, self.size + raw.nbytes],
            }
            self.data.write(raw.data)
            self.size += raw.nbytes
            if self.size >= self.shard_bytes:
                self._flush()

    def _flush(self) -> None:
        """The shard file: 8-byte header length, the JSON header (space-padded to 8 bytes), the data."""
        if self.data is None:
            return
        self.data.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        part = self._part(len(self.files))
        with open(part, "wb") as out, open(part + ".data", "rb") as data:
            out.write(struct.pack("<Q", len(header)) + header)
            shutil.copyfileobj(data, out, 16 << 20)
        os.remove(part + ".data")
        self.files.append(list(self.header))
        self.header, self.data, self.size = {}, None, 0

    def close(self) -> None:
        """Name the shards as transformers does; one shard is ``model.safetensors``."""
        self._flush()
        total = len(self.files)
        weight_map = {}
        for i, names in enumerate(self.files):
            final = SINGLE if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            os.replace(self._part(i), os.path.join(self.out_dir, final))
            weight_map.update(dict.fromkeys(names, final))
        if total > 1:
            with open(os.path.join(self.out_dir, INDEX), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
