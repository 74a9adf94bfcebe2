"""Writes megatron-core's indexed dataset (``.bin`` + ``.idx``, the MMIDIDX format) without torch.

megatron-core's ``IndexedDatasetBuilder`` writes the same bytes, but importing
``megatron.core.datasets.indexed_dataset`` runs ``megatron/core/__init__.py`` (torch,
parallel_state, ...: 5-8 s), which is most of a preprocessing run's wall time on a small
corpus. The format is the one ``_IndexWriter`` writes (megatron-core 0.16.1); the output is
compared byte for byte with Megatron-LM's tools/preprocess_data.py in
tests/data/test_preprocess_upstream.py and read back with megatron-core's ``IndexedDataset`` in
tests/data/test_data_tokenizers.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_npu.data.indexed_format import pack_header


def optimal_dtype(vocab_size: int) -> np.dtype:
    """megatron-core's ``DType.optimal_dtype``: uint16 below 65,500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)


class IndexedDatasetWriter:
    """``IndexedDatasetBuilder.add_document`` / ``finalize`` with the same file layout."""

    def __init__(self, bin_path: str, dtype: Any) -> None:
        self.dtype = np.dtype(dtype)
        self._bin = open(bin_path, "wb")  # noqa: SIM115 - closed in finalize / close
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_document(self, tokens: np.ndarray, lengths: list[int]) -> None:
        self._bin.write(np.asarray(tokens, dtype=self.dtype).tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def close(self) -> None:
        self._bin.close()

    def finalize(self, idx_path: str) -> None:
        self._bin.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(idx_path, "wb") as f:
            f.write(pack_header(self.dtype, len(lengths), len(self.document_indices)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self.document_indices, dtype=np.int64).tobytes(order="C"))
