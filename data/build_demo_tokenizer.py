"""Build data/demo_corpus.jsonl (CPython stdlib docstrings, PSF-2.0) and train demo_spm.model."""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build_corpus(limit_bytes: int = 3_000_000) -> None:
    seen, size = set(), 0
    with open(HERE / "demo_corpus.jsonl", "w", encoding="utf-8") as f:
        for m in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
            if m.name.startswith("_") or m.name in ("this", "antigravity", "idlelib", "tkinter", "turtle"):
                continue
            try:
                mod = importlib.import_module(m.name)
            except Exception:
                continue
            if "site-packages" in (getattr(mod, "__file__", "") or ""):
                continue  # stdlib only (PSF license)
            objs = [mod] + [getattr(mod, n, None) for n in sorted(dir(mod)) if not n.startswith("_")]
            for o in objs:
                d = getattr(o, "__doc__", None)
                if isinstance(d, str) and len(d) > 200 and d not in seen:
                    seen.add(d)
                    line = json.dumps({"text": d.strip()}) + "\n"
                    f.write(line)
                    size += len(line)
                    if size > limit_bytes:
                        return


def train() -> None:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        input=str(HERE / "demo_corpus.txt"),
        model_prefix=str(HERE / "demo_spm"),
        vocab_size=6000,
        model_type="bpe",
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        character_coverage=1.0,
        byte_fallback=True,
        num_threads=2,
        minloglevel=2,
    )


if __name__ == "__main__":
    build_corpus()
    with (
        open(HERE / "demo_corpus.jsonl", encoding="utf-8") as f,
        open(HERE / "demo_corpus.txt", "w", encoding="utf-8") as out,
    ):
        for line in f:
            out.write(json.loads(line)["text"] + "\n")
    train()
    (HERE / "demo_corpus.txt").unlink()
