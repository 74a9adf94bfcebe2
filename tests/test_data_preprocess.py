"""Round trip, determinism across workers, bad input, and tokenizer errors."""

from __future__ import annotations

import json

import pytest

from megatron_npu.data import DEMO_TOKENIZER_MODEL
from megatron_npu.data.preprocess import main, parse_args, run
from megatron_npu.data.tokenizers import TokenizerError, build_tokenizer, pad_vocab_size

TEXTS = ["Hello world, this is a test.", "Second document\nwith a newline.", "x" * 50]


def _args(inp, out, *extra):
    return [
        "--input",
        str(inp),
        "--output-prefix",
        str(out),
        "--tokenizer-type",
        "GPTSentencePieceTokenizer",
        "--tokenizer-model",
        DEMO_TOKENIZER_MODEL,
        *extra,
    ]


def test_round_trip_and_workers(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 200))
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=DEMO_TOKENIZER_MODEL)
    for w in (1, 2):
        r = run(parse_args(_args(inp, tmp_path / f"w{w}", "--append-eod", "--keep-newlines", "--workers", str(w))))
        assert r["docs"] == 600 and not r["problems"]
    ds = IndexedDataset(str(tmp_path / "w1_text_document"))
    assert len(ds) == 600
    for i in range(3):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod
        # SentencePiece normalisation (nmt_nfkc) turns "\n" into a space
        assert tok.detokenize(ids[:-1]) == TEXTS[i].replace("\n", " ")
    for ext in (".bin", ".idx"):
        a = (tmp_path / f"w1_text_document{ext}").read_bytes()
        assert a == (tmp_path / f"w2_text_document{ext}").read_bytes()


def test_two_json_keys_as_megatron_lm(tmp_path):
    """One dataset per key; an empty key of a kept document is a document with no sequence
    and no EOD (Megatron-LM's encode), and workers 1 and 2 agree."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    rows = [
        {"text": "Body one.", "title": "First"},
        {"text": "Body two.", "title": ""},
        {"text": "", "title": "Only a title"},
    ] * 100
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=DEMO_TOKENIZER_MODEL)
    for w in (1, 2):
        r = run(
            parse_args(
                _args(inp, tmp_path / f"w{w}", "--json-keys", "text", "title", "--append-eod", "--workers", str(w))
            )
        )
        assert r["docs"] == 300 and not r["problems"]
    for key in ("text", "title"):
        ds = IndexedDataset(str(tmp_path / f"w1_{key}_document"))
        docs = ds.document_indices
        assert len(docs) == 301
        for d, row in enumerate(rows[:3]):
            seqs = [ds[i].tolist() for i in range(docs[d], docs[d + 1])]
            want = [tok.tokenize(row[key]) + [tok.eod]] if row[key] else []
            assert seqs == want
        for ext in (".bin", ".idx"):
            assert (tmp_path / f"w1_{key}_document{ext}").read_bytes() == (
                tmp_path / f"w2_{key}_document{ext}"
            ).read_bytes()


def test_bad_input(tmp_path, capsys):
    inp = tmp_path / "bad.jsonl"
    inp.write_bytes(b'{"text": "good"}\n{bad json\n{"other": 1}\n{"text": "\xff\xfe"}\n{"text": ""}\n')
    r = run(parse_args(_args(inp, tmp_path / "o")))
    # an empty text is a document with no sequence, as Megatron-LM's tool writes it
    assert r["docs"] == 2
    assert r["problems"] == {"malformed JSON": [2], "missing key": [3], "non-UTF-8 bytes": [4]}
    assert main(_args(inp, tmp_path / "o")) == 0
    assert main(_args(inp, tmp_path / "o", "--strict")) == 1
    assert "malformed JSON" in capsys.readouterr().err


def test_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="--tokenizer-model"):
        build_tokenizer("GPTSentencePieceTokenizer")
    junk = tmp_path / "junk.model"
    junk.write_text("not a model")
    with pytest.raises(TokenizerError, match="--tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(junk))
    with pytest.raises(TokenizerError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer")
    assert pad_vocab_size(50257, 128, 2) == 50432
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert null.vocab_size == 101 and null.eod == 100
