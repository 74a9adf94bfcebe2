"""Megatron-LM tools/preprocess_data.py, streaming and batched, into IndexedDatasetBuilder output."""

from __future__ import annotations

import argparse
import gc
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

from megatron_npu.data.tokenizers import TOKENIZER_TYPES, TokenizerError, build_tokenizer

BATCH = 256
WINDOW_PER_WORKER = 4  # batches in flight per worker: bounds memory whatever the corpus size
_TOK: Any = None
_ARGS: Any = None


def _open(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _tok_args(a: Any) -> dict[str, Any]:
    return dict(
        tokenizer_model=a.tokenizer_model, vocab_file=a.vocab_file, merge_file=a.merge_file, vocab_size=a.vocab_size
    )


def _init(a: Any) -> None:
    global _TOK, _ARGS
    _ARGS = a
    _TOK = build_tokenizer(a.tokenizer_type, **_tok_args(a))


def _dtype(tok: Any) -> Any:
    import numpy as np

    return np.uint16 if tok.vocab_size < 65500 else np.int32  # Megatron's DType.optimal_dtype


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


def _encode(batch: list[tuple[int, bytes]]) -> tuple[list[tuple[int, Any, int]], dict[str, Any]]:
    """Per line (lineno, {key: n_tokens} or problem string, nbytes), and per key one array of
    the batch's tokens in the dataset dtype: one object to pickle back, not one per document."""
    import numpy as np

    a, tok = _ARGS, _TOK
    dtype = _dtype(tok)
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
        if not isinstance(obj, dict) or any(k not in obj for k in a.json_keys):
            parsed.append((lineno, "missing key", len(raw)))
            continue
        parsed.append((lineno, {k: str(obj[k]) for k in a.json_keys}, len(raw)))
    good = [p for p in parsed if isinstance(p[1], dict)]
    # As in Megatron-LM, --keep-newlines only matters with sentence splitting.
    per_key = {k: tok.tokenize_batch_arrays([p[1][k] for p in good]) if good else [] for k in a.json_keys}
    eod = np.array([tok.eod], dtype=dtype)
    out: list[tuple[int, Any, int]] = []
    pieces: dict[str, list[Any]] = {k: [] for k in a.json_keys}
    gi = 0
    for lineno, val, n in parsed:
        if not isinstance(val, dict):
            out.append((lineno, val, n))
            continue
        ids = {k: per_key[k][gi] for k in a.json_keys}
        gi += 1
        if all(len(v) == 0 for v in ids.values()):
            out.append((lineno, "empty document", n))
            continue
        lengths = {}
        for k, v in ids.items():
            # Megatron-LM: an empty key of a non-empty document gets no EOD and no sequence
            with_eod = a.append_eod and len(v) > 0
            pieces[k].append(v)
            if with_eod:
                pieces[k].append(eod)
            lengths[k] = len(v) + int(with_eod)
        out.append((lineno, lengths, n))
    blobs = {k: np.concatenate(v).astype(dtype, copy=False) if v else np.empty(0, dtype) for k, v in pieces.items()}
    return out, blobs


def _batches(path: str) -> Iterator[list[tuple[int, bytes]]]:
    with _open(path) as f:
        it = ((i + 1, line.rstrip(b"\r\n")) for i, line in enumerate(f))
        it = ((i, ln) for i, ln in it if ln.strip())
        while True:
            b = list(islice(it, BATCH))
            if not b:
                return
            yield b


def _check_split_sentences() -> None:
    """Megatron-LM splits with NLTK's punkt; refuse clearly rather than write unsplit data."""
    try:
        import nltk  # noqa: F401
    except ImportError:
        raise TokenizerError(
            "--split-sentences needs NLTK, which is not installed (pip install nltk); or drop --split-sentences"
        ) from None
    raise TokenizerError(
        "--split-sentences is not supported by megatron-npu yet; drop it (GPT pretraining uses whole documents)"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="preprocess_data.py")
    p.add_argument("--input", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument("--tokenizer-model")
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--partitions", type=int, default=1)
    p.add_argument("--log-interval", type=int, default=10000)
    p.add_argument("--keep-newlines", action="store_true")
    p.add_argument(
        "--split-sentences",
        action="store_true",
        help="Megatron-LM's NLTK sentence splitting (needs nltk; not supported yet)",
    )
    p.add_argument("--strict", action="store_true")
    return p.parse_args(argv)


def run(a: argparse.Namespace) -> dict[str, Any]:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tok = build_tokenizer(a.tokenizer_type, **_tok_args(a))  # fail before any work
    if getattr(a, "split_sentences", False):
        _check_split_sentences()
    if not os.path.exists(a.input):
        raise TokenizerError(f"--input {a.input}: no such file")
    dtype = _dtype(tok)
    builders, final = {}, {}
    for k in a.json_keys:
        final[k] = f"{a.output_prefix}_{k}_document"
        builders[k] = IndexedDatasetBuilder(final[k] + ".bin.tmp", dtype=dtype)
    problems: dict[str, list[int]] = {}
    docs = toks = nbytes = 0
    t0 = time.time()
    pool = None
    if a.workers > 1:
        # Keep the garbage collector off the inherited heap (imports, ~300 MB with
        # megatron-core) so forked workers do not copy-on-write it page by page.
        gc.freeze()
        pool = mp.get_context("fork").Pool(a.workers, _init, (a,))
    if pool is None:
        _init(a)
        results = map(_encode, _batches(a.input))
    else:
        # ordered (deterministic output) and bounded (flat memory)
        results = _bounded_imap(pool, _encode, _batches(a.input), WINDOW_PER_WORKER * a.workers)
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
                for k, length in val.items():
                    start = offset[k]
                    offset[k] = start + length
                    builders[k].add_document(blobs[k][start : start + length], [length] if length else [])
                    toks += length
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
        print(f"preprocess_data: error: {e}", file=sys.stderr)
        return 2
    print(f"done: {r['docs']} docs, {r['tokens']} tokens, {r['tokens_per_s']:.0f} tokens/s")
    for kind, lines in r["problems"].items():
        print(f"skipped {len(lines)} lines ({kind}), first at lines {lines[:5]}", file=sys.stderr)
    if r["problems"] and a.strict:
        return 1
    return 0
