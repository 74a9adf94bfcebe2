"""megatron-core's indexed-dataset ``.idx`` layout (``MMIDIDX``), stated once.

The writer (``indexed_writer.py``), the integrity check of the trainer
(``training/data_checks.py``) and the tokenizer-match check (``dataset_check.py``) read it
here. megatron-core's ``megatron.core.datasets.indexed_dataset`` has the same facts, but
importing it runs ``megatron/core/__init__.py`` (torch, parallel_state: 5-8 s), which
preprocessing avoids.

Layout (megatron-core 0.16.1 ``_IndexWriter``): magic, version ``<Q`` = 1, dtype code ``<B``,
sequence count ``<Q``, document count ``<Q``; then int32 sequence lengths, int64 sequence
pointers (byte offsets into ``.bin``) and int64 document indices.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_FIELDS = "<QBQQ"  # version, dtype code, sequence count, document count
HEADER_BYTES = len(MAGIC) + struct.calcsize(_FIELDS)
#: megatron-core's DType codes -> the token dtype they stand for
DTYPES: dict[int, np.dtype] = {
    code: np.dtype(t)
    for code, t in {
        1: np.uint8,
        2: np.int8,
        3: np.int16,
        4: np.int32,
        5: np.int64,
        6: np.float64,
        7: np.float32,
        8: np.uint16,
    }.items()
}
CODES: dict[np.dtype, int] = {dtype: code for code, dtype in DTYPES.items()}


@dataclass(frozen=True)
class IndexHeader:
    version: int
    code: int
    sequences: int
    documents: int

    @property
    def dtype(self) -> np.dtype | None:
        """The token dtype, None for a code megatron-core does not know."""
        return DTYPES.get(self.code)

    # byte offsets of the three tables in the .idx file
    @property
    def lengths_at(self) -> int:
        return HEADER_BYTES

    @property
    def pointers_at(self) -> int:
        return HEADER_BYTES + 4 * self.sequences

    @property
    def documents_at(self) -> int:
        return HEADER_BYTES + 12 * self.sequences

    @property
    def index_bytes(self) -> int:
        """The size of an .idx file with this header."""
        return self.documents_at + 8 * self.documents


def pack_header(dtype: np.dtype, sequences: int, documents: int) -> bytes:
    return MAGIC + struct.pack(_FIELDS, VERSION, CODES[np.dtype(dtype)], sequences, documents)


def read_header(idx_path: str) -> IndexHeader | None:
    """The header of ``idx_path``, or None when the file does not start with one."""
    with open(idx_path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or not head.startswith(MAGIC):
        return None
    return IndexHeader(*struct.unpack(_FIELDS, head[len(MAGIC) :]))
