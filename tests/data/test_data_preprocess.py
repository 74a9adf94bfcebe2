"""Round trip, determinism across workers, bad input, and tokenizer errors."""

from __future__ import annotations

import glob
import json
import sys

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


def test_partitions_input_is_a_pattern(tmp_path, capsys):
    """With --partitions > 1, --input is a glob (as in Megatron-LM's tool): line numbers run
    over the matched files, and a pattern matching nothing is one clear error."""
    (tmp_path / "shard0.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in "abc"))
    (tmp_path / "shard1.jsonl").write_text('{"text": "d"}\n{bad\n')
    pattern = str(tmp_path / "shard?.jsonl")
    r = run(parse_args(_args(pattern, tmp_path / "o", "--partitions", "2")))
    before = 3 if glob.glob(pattern)[0].endswith("shard0.jsonl") else 0  # the tool's file order
    assert r["docs"] == 4 and r["problems"] == {"malformed JSON": [before + 2]}
    for flags, message in (
        (["--partitions", "2"], "no file matches"),
        (["--partitions", "0"], "--partitions 0: must be at least 1"),
        ([], "no such file"),
    ):
        assert main(_args(tmp_path / "none*.jsonl", tmp_path / "o", *flags)) == 2
        assert message in capsys.readouterr().err


def _nltk_data(monkeypatch, root):
    """nltk's data path set to ``root`` alone (no NLTK_DATA): what nltk finds is only what a test put there."""
    nltk = pytest.importorskip("nltk", minversion="3.9", reason="nltk >= 3.9 is not installed (pip install nltk)")
    monkeypatch.delenv("NLTK_DATA", raising=False)
    monkeypatch.setattr(nltk.data, "path", [str(root)])
    return nltk


def test_split_sentences_needs_nltk_and_its_data(tmp_path, monkeypatch, capsys):
    """One line naming what to install, before any output is written."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"text": "One. Two."}) + "\n")
    monkeypatch.setitem(sys.modules, "nltk", None)  # as if not installed
    assert main(_args(inp, tmp_path / "o", "--split-sentences")) == 2
    err = capsys.readouterr().err
    assert "pip install nltk" in err and len(err.strip().splitlines()) == 1
    monkeypatch.delitem(sys.modules, "nltk")
    _nltk_data(monkeypatch, tmp_path / "nltk_data")
    assert main(_args(inp, tmp_path / "o", "--split-sentences", "--lang", "english")) == 2
    err = capsys.readouterr().err
    assert "python -m nltk.downloader punkt" in err and "english" in err and len(err.strip().splitlines()) == 1
    # with NLTK_DATA set Megatron-LM's tool loads $NLTK_DATA/tokenizers/punkt/<lang>.pickle
    monkeypatch.setenv("NLTK_DATA", str(tmp_path))
    assert main(_args(inp, tmp_path / "o", "--split-sentences")) == 2
    err = capsys.readouterr().err
    assert "tokenizers/punkt/english.pickle" in err and "NLTK_DATA" in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("o_*"))


def test_split_sentences_documents(tmp_path, monkeypatch):
    """Sentences are the sequences of a document in ``_sentence`` files; a value that is not a
    string is a skipped line (Megatron-LM's splitter fails on it)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    nltk = _nltk_data(monkeypatch, tmp_path / "nltk_data")
    from nltk.tokenize.punkt import PunktTrainer, save_punkt_params

    trainer = PunktTrainer()
    trainer.train(" ".join(TEXTS * 20), finalize=True)
    (tmp_path / "nltk_data" / "tokenizers" / "punkt_tab").mkdir(parents=True)
    save_punkt_params(trainer.get_params(), dir=str(tmp_path / "nltk_data" / "tokenizers" / "punkt_tab" / "english"))
    rows = [{"text": "First one here. Then a second one! A third?"}, {"text": ["already", "split"]}, {"text": "Alone"}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows * 10))
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=DEMO_TOKENIZER_MODEL)
    splitter = nltk.load("nltk:tokenizers/punkt/english.pickle")
    # two workers: the splitter built before the fork serves them
    r = run(parse_args(_args(inp, tmp_path / "o", "--split-sentences", "--append-eod", "--workers", "2")))
    assert r["docs"] == 20 and r["problems"] == {"not a string (--split-sentences)": list(range(2, 30, 3))}
    ds = IndexedDataset(str(tmp_path / "o_text_sentence"))
    want = [tok.tokenize(s) for s in splitter.tokenize(rows[0]["text"])]
    assert len(want) == 3
    for d, doc in enumerate(([*want[:-1], want[-1] + [tok.eod]], [tok.tokenize("Alone") + [tok.eod]]) * 10):
        assert [ds[i].tolist() for i in range(ds.document_indices[d], ds.document_indices[d + 1])] == doc
