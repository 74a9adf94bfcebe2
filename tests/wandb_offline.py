"""Read what an offline wandb run logged, from its run-*.wandb file (no network, no wandb sync).

The file is wandb's record log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks
of chunks, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)
around a serialised wandb Record protobuf.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7


def _records(data: bytes):
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def history(save_dir: Path) -> list[dict]:
    """The logged rows (each a dict with '_step') of the one offline run under save_dir/wandb."""
    from wandb.proto import wandb_internal_pb2

    (run_file,) = save_dir.glob("wandb/offline-run-*/run-*.wandb")
    rows = []
    for data in _records(run_file.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows
