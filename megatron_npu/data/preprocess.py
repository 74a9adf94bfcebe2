"""Megatron-LM core_v0.16.1's tools/preprocess_data.py: the same .bin/.idx bytes, streamed and batched.

The same tokenizer (``tokenizers.preprocessing_encoder``: megatron-core's unless
``--legacy-tokenizer``), the same documents (a list value is pre-split sentences, empty
sequences dropped, the eod after a key's last sequence, a key with no tokens a document with
no sequence) in the same order (--partitions reorders them as that tool does), and with
--split-sentences the same punkt sentences (``sentences.py``) in ``_sentence`` files; that tool
first writes a ``_ss`` jsonl of the sentences and needs a second run to encode it, here one run
splits and encodes without the intermediate file. In addition,
bad lines are counted and reported (``--strict`` fails on them) instead of stopping the run,
and the output is renamed into place at the end.
"""

from __future__ import annotations

import argparse
import gc
import glob
import gzip
import json
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import numpy as np

from megatron_npu.data.indexed_writer import IndexedDatasetWriter, optimal_dtype
from megatron_npu.data.tokenizers import TokenizerError, TokenizerSection, preprocessing_encoder
from megatron_npu.training.sections.base import add_section_arguments

BATCH = 256
WINDOW_PER_WORKER = 4  # batches in flight per worker: bounds memory whatever the corpus size
_TOK: Any = None
_ARGS: Any = None
_SPLIT: Any = None  # --split-sentences: built once before the workers fork, inherited by them


def _open(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _options(a: Any) -> TokenizerSection:
    # Megatron-LM's tool sets vocab_extra_ids = 0 whatever the command line says
    return TokenizerSection.from_values(a).replace(vocab_extra_ids=0)


def _init(a: Any) -> None:
    global _TOK, _ARGS
    _ARGS = a
    # Parallelism comes from --workers processes: HF tokenizers' batch encode would otherwise
    # run a thread per core in every worker (as sentencepiece is held to num_threads=1).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _TOK = preprocessing_encoder(_options(a))


def _bounded_imap(pool: Any, fn: Callable, items: Iterator, window: int) -> Iterator:
    """Ordered like Pool.imap, but at most `window` batches submitted and not yet consumed.

    Pool.imap queues every finished result in an unbounded deque, so when the writer falls
    behind (a busy host) memory grows with the corpus; this keeps it flat.
    """
    pending: deque = deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _sentences(value: Any) -> list[str]:
    """A key's texts: Megatron-LM's tool takes a list as sentences already split (what its
    --split-sentences writes), one sequence each; anything else is one text."""
    if isinstance(value, list):
        return [v if isinstance(v, str) else str(v) for v in value]
    return [value if isinstance(value, str) else str(value)]


def _split(value: Any) -> list[str] | str:
    """--split-sentences: a text's sentences (Megatron-LM's tool fails on any other value)."""
    if not isinstance(value, str):
        return "not a string (--split-sentences)"
    return _SPLIT(value)


def _encode(batch: list[tuple[int, bytes]]) -> tuple[list[tuple[int, Any, int]], dict[str, Any]]:
    """Per line (lineno, {key: sequence lengths} or problem string, nbytes), and per key one
    array of the batch's tokens in the dataset dtype: one object to pickle back, not one per
    document. Megatron-LM's encode: empty sequences are dropped, the eod goes after a key's
    last sequence, and a key with no tokens is a document with no sequence (and no eod)."""
    a, tok = _ARGS, _TOK
    keys = a.json_keys
    dtype = optimal_dtype(tok.vocab_size)
    parsed: list[tuple[int, Any, int]] = []
    for lineno, raw in batch:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            parsed.append((lineno, "non-UTF-8 bytes", len(raw)))
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            parsed.append((lineno, "malformed JSON", len(raw)))
            continue
        if not isinstance(obj, dict) or any(k not in obj for k in keys):
            parsed.append((lineno, "missing key", len(raw)))
            continue
        if _SPLIT is None:
            parsed.append((lineno, {k: _sentences(obj[k]) for k in keys}, len(raw)))
            continue
        split = {k: _split(obj[k]) for k in keys}
        bad = next((v for v in split.values() if isinstance(v, str)), None)
        parsed.append((lineno, bad or split, len(raw)))
    good = [val for _, val, _ in parsed if isinstance(val, dict)]
    # As in Megatron-LM, --keep-newlines only matters with sentence splitting.
    encoded = {k: iter(tok.tokenize_batch_arrays([t for val in good for t in val[k]])) for k in keys}
    eod = np.array([tok.eod], dtype=dtype)
    out: list[tuple[int, Any, int]] = []
    pieces: dict[str, list[Any]] = {k: [] for k in keys}
    for lineno, val, n in parsed:
        if not isinstance(val, dict):
            out.append((lineno, val, n))
            continue
        lengths = {}
        for k in keys:
            seqs = [ids for ids in islice(encoded[k], len(val[k])) if len(ids)]
            lens = [len(ids) for ids in seqs]
            pieces[k].extend(seqs)
            if a.append_eod and seqs:
                pieces[k].append(eod)
                lens[-1] += 1
            lengths[k] = lens
        out.append((lineno, lengths, n))
    blobs = {k: np.concatenate(v).astype(dtype, copy=False) if v else np.empty(0, dtype) for k, v in pieces.items()}
    return out, blobs


def _input_files(a: argparse.Namespace) -> list[str]:
    """--input, or with --partitions > 1 what Megatron-LM's tool reads then: the files its
    pattern matches, in ``glob.glob``'s order (so the same files in the same order as that tool)."""
    return glob.glob(a.input) if a.partitions > 1 else [a.input]


def _lines(a: argparse.Namespace) -> Iterator[tuple[int, bytes]]:
    """(line number, line) in the order Megatron-LM's tool writes the documents.

    With --partitions P > 1 it deals the lines of all matched files to P partition files,
    encodes each and concatenates them in partition order: line n goes to partition n % P, or
    with --keep-sequential-samples to n // ceil(lines / P), which keeps the input order. The
    same order is read here in P passes (no partition files written); line numbers count every
    line of the matched files in order, as the partitioning does.
    """
    files, parts = _input_files(a), max(a.partitions, 1)
    passes = [None] if parts == 1 or a.keep_sequential_samples else range(parts)
    for part in passes:
        n = 0
        for path in files:
            with _open(path) as f:
                for line in f:
                    n += 1
                    if part is None or (n - 1) % parts == part:
                        yield n, line.rstrip(b"\r\n")


def _batches(a: argparse.Namespace) -> Iterator[list[tuple[int, bytes]]]:
    it = ((i, ln) for i, ln in _lines(a) if ln.strip())
    while True:
        b = list(islice(it, BATCH))
        if not b:
            return
        yield b


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM core_v0.16.1's tools/preprocess_data.py flags (--workers defaults to 1 here)."""
    p = argparse.ArgumentParser(prog="megatron-npu preprocess")  # scripts/preprocess_data.py is the same command
    add_section_arguments(p, TokenizerSection, "tokenizer")  # Megatron-LM's _add_tokenizer_args, the trainer's
    g = p.add_argument_group(title="input data")
    g.add_argument("--input", required=True, help="jsonl file, one document per line (a glob with --partitions)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each line (default: text)")
    g.add_argument(
        "--split-sentences",
        action="store_true",
        help="Megatron-LM's NLTK punkt sentence splitting (needs nltk and its punkt_tab data)",
    )
    g.add_argument("--keep-newlines", action="store_true", help="with --split-sentences: keep newlines in sentences")
    g = p.add_argument_group(title="tokenization process")
    g.add_argument("--append-eod", action="store_true", help="append the tokenizer's end-of-document token")
    g.add_argument("--lang", type=str, default="english", help="NLTK language (with --split-sentences)")
    g = p.add_argument_group(title="output data")
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_KEY_document.bin/.idx per --json-keys")
    g = p.add_argument_group(title="runtime")
    g.add_argument("--workers", type=int, default=1, help="encoding processes (default: 1)")
    g.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="Megatron-LM's document order for P file partitions (--input is then a glob); one output",
    )
    g.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="with --partitions: contiguous partitions, so the input order is kept",
    )
    g.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    g.add_argument("--strict", action="store_true", help="exit 1 when any input line was skipped")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    if a.tokenizer_type is None:
        p.error("the following arguments are required: --tokenizer-type")
    return a


def run(a: argparse.Namespace) -> dict[str, Any]:
    global _SPLIT
    tok = preprocessing_encoder(_options(a))  # fail before any work
    _SPLIT = None
    if getattr(a, "split_sentences", False):
        from megatron_npu.data.sentences import build_splitter  # imports nltk: only when asked

        _SPLIT = build_splitter(a.lang, a.keep_newlines)
    if a.partitions < 1:
        raise TokenizerError(f"--partitions {a.partitions}: must be at least 1")
    files = _input_files(a)
    if not files or not all(map(os.path.exists, files)):
        what = "no file matches this pattern (--partitions > 1)" if a.partitions > 1 else "no such file"
        raise TokenizerError(f"--input {a.input}: {what}")
    dtype = optimal_dtype(tok.vocab_size)
    builders, final = {}, {}
    level = "sentence" if _SPLIT is not None else "document"  # Megatron-LM's file names
    for k in a.json_keys:
        final[k] = f"{a.output_prefix}_{k}_{level}"
        builders[k] = IndexedDatasetWriter(final[k] + ".bin.tmp", dtype)
    problems: dict[str, list[int]] = {}
    docs = toks = nbytes = 0
    t0 = time.time()
    pool = None
    if a.workers > 1:
        # Keep the garbage collector off the inherited heap so forked workers do not
        # copy-on-write it page by page.
        gc.freeze()
        pool = mp.get_context("fork").Pool(a.workers, _init, (a,))
    if pool is None:
        _init(a)
        results = map(_encode, _batches(a))
    else:
        # ordered (deterministic output) and bounded (flat memory)
        results = _bounded_imap(pool, _encode, _batches(a), WINDOW_PER_WORKER * a.workers)
    next_log = a.log_interval
    try:
        for entries, blobs in results:
            offset = dict.fromkeys(blobs, 0)
            for lineno, val, n in entries:
                nbytes += n
                if isinstance(val, str):
                    problems.setdefault(val, []).append(lineno)
                    continue
                docs += 1
                for k, lengths in val.items():
                    start = offset[k]
                    size = sum(lengths)
                    offset[k] = start + size
                    builders[k].add_document(blobs[k][start : start + size], lengths)
                    toks += size
            if docs >= next_log:
                next_log += a.log_interval
                dt = max(time.time() - t0, 1e-9)
                print(
                    f"processed {docs} docs ({docs / dt:.0f} docs/s, {toks / dt:.0f} tokens/s, "
                    f"{nbytes / dt / 1e6:.2f} MB/s)",
                    file=sys.stderr,
                )
    except BaseException:
        if pool is not None:
            pool.terminate()  # a failed run must not leave workers behind
        for b in builders.values():
            b.close()
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
            gc.unfreeze()
    for k, b in builders.items():
        b.finalize(final[k] + ".idx.tmp")
        os.replace(final[k] + ".bin.tmp", final[k] + ".bin")  # rename last: no half-written dataset
        os.replace(final[k] + ".idx.tmp", final[k] + ".idx")
    dt = max(time.time() - t0, 1e-9)
    return dict(docs=docs, tokens=toks, seconds=dt, tokens_per_s=toks / dt, problems=problems)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        r = run(a)
    except TokenizerError as e:
        print(f"megatron-npu preprocess: error: {e}", file=sys.stderr)
        return 2
    print(f"done: {r['docs']} docs, {r['tokens']} tokens, {r['tokens_per_s']:.0f} tokens/s")
    for kind, lines in r["problems"].items():
        print(f"skipped {len(lines)} lines ({kind}), first at lines {lines[:5]}", file=sys.stderr)
    if r["problems"] and a.strict:
        return 1
    return 0
