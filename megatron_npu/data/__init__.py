"""Tokenizers, indexed-dataset preprocessing and the bundled demo corpus."""

from __future__ import annotations

import os
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2] / "data"
DEMO_CORPUS = str(_ROOT / "demo_corpus.jsonl")
DEMO_TOKENIZER_MODEL = str(_ROOT / "demo_spm.model")


def ensure_demo_dataset(output_dir: str) -> str:
    """Preprocess the bundled corpus into output_dir (reused when newer than corpus+model)."""
    from megatron_npu.data.preprocess import parse_args, run

    os.makedirs(output_dir, exist_ok=True)
    prefix = os.path.join(output_dir, "demo")
    idx = prefix + "_text_document.idx"
    src = max(os.path.getmtime(DEMO_CORPUS), os.path.getmtime(DEMO_TOKENIZER_MODEL))
    if not (os.path.exists(idx) and os.path.getmtime(idx) >= src):
        run(
            parse_args(
                [
                    "--input",
                    DEMO_CORPUS,
                    "--output-prefix",
                    prefix,
                    "--append-eod",
                    "--tokenizer-type",
                    "GPTSentencePieceTokenizer",
                    "--tokenizer-model",
                    DEMO_TOKENIZER_MODEL,
                ]
            )
        )
    return prefix + "_text_document"
