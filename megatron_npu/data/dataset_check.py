"""A dataset written with another tokenizer than the trainer's, refused at start-up in one message.

megatron-core's GPTDataset trusts the tokenizer it is given: ids past the vocabulary index the
embedding out of range (an error deep in a forward pass, or garbage on some devices) and a
different eod makes ``--eod-mask-loss`` / ``--reset-attention-mask`` silently wrong. The
classic case is a SentencePiece dataset from Megatron-LM's legacy tokenizer (eod ``<EOD>``,
appended after the vocabulary) trained with megatron-core's (eod = the model's eos), or the
reverse. What can be read cheaply from the files is compared with the tokenizer:

- the token dtype: both preprocessing tools choose it from the vocabulary size (uint16 below
  65,500 ids, int32 above);
- the largest id in a sample (the first tokens, and the last token of sampled documents)
  against the vocabulary size;
- the eod: when every sampled document ends with the same id, and that id is this
  tokenizer's eos/bos/pad rather than its eod, the data was written with another eod.

Reads the ``.idx`` header and memory-maps both files: constant time whatever the corpus size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_npu.data.indexed_format import read_header
from megatron_npu.data.indexed_writer import optimal_dtype
from megatron_npu.data.legacy_tokenizers import TokenizerError

HEAD_TOKENS = 1 << 20  # ids read from the start of the .bin
SAMPLED_DOCUMENTS = 256  # documents whose last token is read


def data_prefixes(args: Any) -> list[tuple[str, str]]:
    """(flag, prefix) for every dataset the arguments name (weights dropped)."""
    found = []
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        values = getattr(args, flag[2:].replace("-", "_"), None) or []
        if len(values) % 2 == 0 and values and _is_number(values[0]):
            values = values[1::2]  # weight-prefix pairs
        found += [(flag, v) for v in values]
    return found


def check_dataset_tokenizer(args: Any, tokenizer: Any) -> None:
    """TokenizerError naming the dataset, the tokenizer flags and what differs."""
    if getattr(args, "mock_data", False):
        return
    for flag, prefix in data_prefixes(args):
        problem = mismatch(prefix, tokenizer)
        if problem:
            legacy = "--legacy-tokenizer" if getattr(args, "legacy_tokenizer", False) else "megatron-core's tokenizer"
            raise TokenizerError(
                f"{flag} {prefix}: {problem}: the dataset was written with another tokenizer than "
                f"--tokenizer-type {args.tokenizer_type} ({legacy}); preprocess it with the same "
                "--tokenizer-type, model and --legacy-tokenizer setting as training"
            )


def mismatch(prefix: str, tokenizer: Any) -> str | None:
    """What in ``prefix``'s files contradicts ``tokenizer``, or None."""
    header = read_header(prefix + ".idx")
    if header is None or header.dtype is None:
        return None  # not an index: the data checks of the trainer's validation name that
    dtype, vocab = header.dtype, tokenizer.vocab_size
    if dtype != optimal_dtype(vocab):
        return f"its tokens are {dtype.name}, a tokenizer of {vocab} ids writes {optimal_dtype(vocab).name}"
    index = np.memmap(prefix + ".idx", mode="r", dtype=np.uint8)
    lengths = index[header.lengths_at : header.pointers_at].view(np.int32)
    pointers = index[header.pointers_at : header.documents_at].view(np.int64)
    doc_index = index[header.documents_at : header.index_bytes].view(np.int64)
    tokens = np.memmap(prefix + ".bin", mode="r", dtype=dtype)
    ends = _document_ends(lengths, pointers // dtype.itemsize, doc_index)
    last = tokens[ends] if len(ends) else np.empty(0, dtype)
    top = max(int(tokens[:HEAD_TOKENS].max(initial=0)), int(last.max(initial=0)))
    if top >= vocab:
        return f"it holds token id {top}, past this tokenizer's {vocab} ids"
    eod = _id(tokenizer, "eod")
    if len(last) >= 2 and (last == last[0]).all() and eod is not None and int(last[0]) != eod:
        end = int(last[0])
        names = [n for n in ("eos", "bos", "pad") if _id(tokenizer, n) == end]
        if names:
            return f"its documents end with id {end}, this tokenizer's {names[0]}, while its eod is {eod}"
    return None


def _document_ends(lengths: np.ndarray, starts: Any, doc_index: np.ndarray) -> np.ndarray:
    """Token offsets of the last token of up to SAMPLED_DOCUMENTS non-empty documents."""
    if len(doc_index) < 2 or len(lengths) == 0:
        return np.empty(0, np.int64)
    picks = np.unique(np.linspace(1, len(doc_index) - 1, min(SAMPLED_DOCUMENTS, len(doc_index) - 1)).astype(np.int64))
    picks = picks[doc_index[picks] > doc_index[picks - 1]]  # documents with a sequence
    last_sequence = doc_index[picks] - 1
    last_sequence = last_sequence[lengths[last_sequence] > 0]
    return np.asarray(starts[last_sequence], np.int64) + lengths[last_sequence] - 1


def _id(tokenizer: Any, name: str) -> int | None:
    """A special id, or None where the tokenizer has none (megatron-core raises for some)."""
    try:
        value = getattr(tokenizer, name)
    except Exception:
        return None
    return int(value) if isinstance(value, int | np.integer) and value >= 0 else None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
