"""Megatron-LM tools/preprocess_data.py, streaming and batched, into IndexedDatasetBuilder output."""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator
from itertools import islice
from typing import Any

from megatron_npu.data.tokenizers import TOKENIZER_TYPES, TokenizerError, build_tokenizer

BATCH = 256
_TOK: Any = None
_ARGS: Any = None


def _open(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _tok_args(a: Any) -> dict[str, Any]:
    return dict(tokenizer_model=a.tokenizer_model, vocab_file=a.vocab_file,
                merge_file=a.merge_file, vocab_size=a.vocab_size)


def _init(a: Any) -> None:
    global _TOK, _ARGS
    _ARGS = a
    _TOK = build_tokenizer(a.tokenizer_type, **_tok_args(a))


def _encode(batch: list[tuple[int, bytes]]) -> list[tuple[int, Any, int]]:
    """Per line: (lineno, {key: ids} or problem string, nbytes)."""
    a, tok = _ARGS, _TOK
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
    out: list[tuple[int, Any, int]] = []
    good = [p for p in parsed if isinstance(p[1], dict)]
    per_key = {}
    for k in a.json_keys:
        # As in Megatron-LM, --keep-newlines only matters with sentence splitting.
        texts = [p[1][k] for p in good]
        per_key[k] = tok.tokenize_batch(texts) if texts else []
    gi = 0
    for lineno, val, n in parsed:
        if isinstance(val, dict):
            ids = {k: list(per_key[k][gi]) for k in a.json_keys}
            gi += 1
            if all(len(v) == 0 for v in ids.values()):
                out.append((lineno, "empty document", n))
                continue
            if a.append_eod:
                for v in ids.values():
                    v.append(tok.eod)
            out.append((lineno, ids, n))
        else:
            out.append((lineno, val, n))
    return out


def _batches(path: str) -> Iterator[list[tuple[int, bytes]]]:
    with _open(path) as f:
        it = ((i + 1, line.rstrip(b"\r\n")) for i, line in enumerate(f))
        it = ((i, ln) for i, ln in it if ln.strip())
        while True:
            b = list(islice(it, BATCH))
            if not b:
                return
            yield b


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
    p.add_argument("--strict", action="store_true")
    return p.parse_args(argv)


def run(a: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tok = build_tokenizer(a.tokenizer_type, **_tok_args(a))  # fail before any work
    if not os.path.exists(a.input):
        raise TokenizerError(f"--input {a.input}: no such file")
    # Megatron's DType.optimal_dtype: uint16 below 65500
    dtype = np.uint16 if tok.vocab_size < 65500 else np.int32
    builders, final = {}, {}
    for k in a.json_keys:
        final[k] = f"{a.output_prefix}_{k}_document"
        builders[k] = IndexedDatasetBuilder(final[k] + ".bin.tmp", dtype=dtype)
    problems: dict[str, list[int]] = {}
    docs = toks = nbytes = 0
    t0 = time.time()
    pool = mp.get_context("fork").Pool(a.workers, _init, (a,)) if a.workers > 1 else None
    if pool is None:
        _init(a)
        results = map(_encode, _batches(a.input))
    else:
        results = pool.imap(_encode, _batches(a.input), chunksize=1)  # ordered: deterministic
    next_log = a.log_interval
    for res in results:
        for lineno, val, n in res:
            nbytes += n
            if isinstance(val, str):
                problems.setdefault(val, []).append(lineno)
                continue
            docs += 1
            for k, ids in val.items():
                builders[k].add_document(ids, [len(ids)])
                toks += len(ids)
        if docs >= next_log:
            next_log += a.log_interval
            dt = max(time.time() - t0, 1e-9)
            print(f"processed {docs} docs ({docs/dt:.0f} docs/s, {toks/dt:.0f} tokens/s, "
                  f"{nbytes/dt/1e6:.2f} MB/s)", file=sys.stderr)
    if pool is not None:
        pool.close()
        pool.join()
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
