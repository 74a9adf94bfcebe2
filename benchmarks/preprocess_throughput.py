"""Whole-process preprocessing time: this project's script against Megatron-LM core_v0.16.1's tool.

    python benchmarks/preprocess_throughput.py [--megatron-lm PATH] [--mb 16] [--rounds 2]

Both tools run as a user runs them, one fresh process per run, timed from launch to exit
(start-up included): ``python scripts/preprocess_data.py`` and ``python -m megatron_npu.run
tools/preprocess_data.py`` (Megatron-LM's megatron/training imports triton unguarded, so off
CUDA it runs through the patch layer). The corpus is natural-language text with no repeated
document, built on this machine: man pages (roff markup stripped), /usr/share/doc text files
and the docstrings of the Python standard library, deduplicated, ``--mb`` megabytes. Two
tokenizers: the bundled SentencePiece model (``SentencePieceTokenizer``) and a byte-level BPE
HuggingFace tokenizer trained on the first megabytes of the corpus (saved with transformers,
no hub). For each tokenizer and 1 and 2 workers the two tools run alternately, ``--rounds``
times; the table shows the median wall times and Megatron-LM's over ours. Every pair of
outputs is compared byte for byte. Ratios are measured within this one run; never a timed test.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARBALL = ROOT.parent / "shared" / "megatron-lm" / "megatron-lm-core_v0.16.1-training.tar.gz"
SPM = ROOT / "data" / "demo_spm.model"
_ROFF = re.compile(r"\\f[BIRP]|\\\(..|\\[-&e|^]|\\s[-+]?\d")


def man_pages() -> Iterator[str]:
    for path in sorted(Path("/usr/share/man").rglob("*.gz")):
        try:
            raw = gzip.decompress(path.read_bytes()).decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError):
            continue
        lines = [_ROFF.sub("", ln) for ln in raw.splitlines() if not ln.startswith((".", "'"))]
        yield "\n".join(ln for ln in lines if ln.strip())


def doc_files() -> Iterator[str]:
    for path in sorted(Path("/usr/share/doc").rglob("*")):
        if not path.is_file() or path.stat().st_size > 1 << 20:
            continue
        try:
            data = path.read_bytes()
            yield (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError):
            continue


def docstrings() -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    yield doc


def documents(texts: Iterator[str], limit: int = 8000) -> Iterator[str]:
    """Long texts (changelogs, big man pages) cut at blank lines (or, in a long paragraph, at
    line ends) into documents of about ``limit`` characters, so the corpus has many documents,
    as a pretraining corpus does."""
    for text in texts:
        chunk: list[str] = []
        size = 0
        for paragraph in text.split("\n\n"):
            for part in [paragraph] if len(paragraph) <= limit else paragraph.split("\n"):
                if chunk and size + len(part) > limit:
                    yield "\n".join(chunk)
                    chunk, size = [], 0
                chunk.append(part)
                size += len(part) + 1
            chunk.append("")  # the blank line between paragraphs
        if any(chunk):
            yield "\n".join(chunk).rstrip("\n")


def build_corpus(path: Path, megabytes: int) -> tuple[int, int]:
    """Unique documents, interleaved from the three sources, up to ``megabytes``."""
    seen: set[bytes] = set()
    size = docs = 0
    sources = [documents(man_pages()), documents(doc_files()), documents(docstrings())]
    with open(path, "w", encoding="utf-8") as f:
        while sources and size < megabytes << 20:
            for source in list(sources):
                text = next(source, None)
                if text is None:
                    sources.remove(source)
                    continue
                digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
                if len(text) < 100 or digest in seen:
                    continue
                seen.add(digest)
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                f.write(line)
                size += len(line.encode())
                docs += 1
    return docs, size


def hf_tokenizer(corpus: Path, out: Path) -> None:
    """A byte-level BPE (8,000 ids, eos </s>) trained on the corpus's first 4 MB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts, size = [], 0
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size > 4 << 20:
                break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(
        str(out)
    )


def timed(cmd: list[str], env: dict[str, str], cwd: Path) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{done.stderr[-3000:]}")
    return wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megatron-lm", help=f"a Megatron-LM core_v0.16.1 checkout (default: extract {TARBALL.name})")
    p.add_argument("--mb", type=int, default=16, help="corpus size in MB")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs per configuration")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="preprocess-bench-"))
    checkout = Path(a.megatron_lm) if a.megatron_lm else None
    if checkout is None:
        with tarfile.open(TARBALL) as archive:
            archive.extractall(work / "megatron-lm", filter="data")
        checkout = work / "megatron-lm"
    corpus = work / "corpus.jsonl"
    t0 = time.perf_counter()
    docs, size = build_corpus(corpus, a.mb)
    hf_tokenizer(corpus, work / "hf")
    print(f"corpus: {docs} unique documents, {size / 2**20:.1f} MB (built in {time.perf_counter() - t0:.0f} s)")
    env = dict(os.environ, MEGATRON_NPU_DEVICE=os.environ.get("MEGATRON_NPU_DEVICE", "cpu"), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), str(ROOT), env.get("PYTHONPATH", "")])
    tokenizers = {
        "SentencePiece": ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(SPM)],
        "HuggingFace": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(work / "hf")],
    }
    ours_cmd = [sys.executable, str(ROOT / "scripts" / "preprocess_data.py")]
    upstream_cmd = [sys.executable, "-m", "megatron_npu.run", str(checkout / "tools" / "preprocess_data.py")]
    walls: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(a.rounds):
        for name, flags in tokenizers.items():
            for workers in (1, 2):
                for tool, cmd in (("ours", ours_cmd), ("megatron-lm", upstream_cmd)):
                    prefix = work / f"{tool}-{name}-{workers}"
                    argv = ["--input", str(corpus), "--output-prefix", str(prefix), "--append-eod", *flags]
                    wall = timed([*cmd, *argv, "--workers", str(workers)], env, work)
                    walls.setdefault((name, workers, tool), []).append(wall)
    print(f"\n{'tokenizer':<14}{'workers':>8}{'ours s':>10}{'Megatron-LM s':>15}{'ratio':>8}  identical")
    for name in tokenizers:
        for workers in (1, 2):
            ours = statistics.median(walls[(name, workers, "ours")])
            up = statistics.median(walls[(name, workers, "megatron-lm")])
            same = all(
                (work / f"ours-{name}-{workers}_text_document{ext}").read_bytes()
                == (work / f"megatron-lm-{name}-{workers}_text_document{ext}").read_bytes()
                for ext in (".bin", ".idx")
            )
            print(f"{name:<14}{workers:>8}{ours:>10.2f}{up:>15.2f}{up / ours:>7.2f}x  {same}")
    print(f"\n(median of {a.rounds} alternating runs each; outputs under {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
