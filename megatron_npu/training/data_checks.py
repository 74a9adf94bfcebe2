"""A truncated or corrupt ``.bin`` / ``.idx`` pair is refused before training, naming the file.

megatron-core's IndexedDataset reads the ``.idx`` header with asserts (a bad magic is an
``AssertionError`` from deep inside the dataset builder, after the process groups exist)
and memory-maps the ``.bin`` without comparing its size with the index: a truncated
``.bin`` is found only when a sample past its end is read (SIGBUS under mmap, or a short
read). The checks here read the header and the last entries of the index (constant
time, however large the corpus) and compare the file sizes with what the index describes.

The ``.idx`` layout is stated in ``megatron_npu/data/indexed_format.py``.
"""

from __future__ import annotations

import os

import numpy as np

from ..data.indexed_format import VERSION, read_header
from ..policy import ConfigError

REBUILD = "rebuild it with `megatron-npu preprocess` (or copy it again)"


def check_indexed_dataset(prefix: str, flag: str) -> None:
    """Raise ConfigError naming the file when ``prefix``.idx / .bin are not a consistent pair."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    idx_size = os.path.getsize(idx)
    header = read_header(idx)
    if header is None:
        raise ConfigError(f"{flag}: {idx} is not a Megatron index file (bad or truncated header); {REBUILD}")
    sequences, documents = header.sequences, header.documents
    if header.version != VERSION or header.dtype is None:
        raise ConfigError(
            f"{flag}: {idx}: unknown index version {header.version} or token type code {header.code}; {REBUILD}"
        )
    if idx_size < header.index_bytes:
        raise ConfigError(
            f"{flag}: {idx} is truncated: {idx_size} bytes, its header describes {header.index_bytes} "
            f"({sequences} sequences, {documents} documents); {REBUILD}"
        )
    index = np.memmap(idx, mode="r", dtype=np.uint8)
    last_length = int(index[header.lengths_at + (sequences - 1) * 4 :][:4].view(np.int32)[0]) if sequences else 0
    last_pointer = int(index[header.pointers_at + (sequences - 1) * 8 :][:8].view(np.int64)[0]) if sequences else 0
    last_document = int(index[header.documents_at + (documents - 1) * 8 :][:8].view(np.int64)[0]) if documents else 0
    del index
    if last_document != sequences or last_length < 0 or last_pointer < 0:
        raise ConfigError(f"{flag}: {idx} is corrupt (its document and sequence tables disagree); {REBUILD}")
    bin_expected = last_pointer + last_length * header.dtype.itemsize
    bin_size = os.path.getsize(bin_)
    if bin_size != bin_expected:
        problem = "is truncated" if bin_size < bin_expected else "does not match its index"
        raise ConfigError(
            f"{flag}: {bin_} {problem}: {bin_size} bytes, {idx} describes {bin_expected}; "
            f"{REBUILD} (a .bin and .idx are written together and must be copied together)"
        )
