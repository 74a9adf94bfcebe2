"""Every offline-buildable --tokenizer-type, in both of Megatron-LM 0.16.1's systems.

The default is megatron-core's own tokenizer (``megatron.core.tokenizers``, built by its
``build_tokenizer(args)`` as Megatron-LM's tools and pretrain_gpt.py build it): the three
SentencePiece types encode alike with eod = the model's eos id, the HuggingFace one adds no
post-processor specials. ``--legacy-tokenizer`` (``legacy_tokenizer=True``) gives
megatron/training/tokenizer/tokenizer.py's semantics: _SentencePieceTokenizer adds
<CLS>,<SEP>,<EOD>,<MASK> after the model's pieces (eod = <EOD>, eos = the model's </s>) and
turns their literal text into ids; _GPTSentencePieceTokenizer and _Llama2Tokenizer keep the
model's ids (eod = eos_id), Llama2 prepends BOS; _NullTokenizer has vocab_size + 1 ids with
eod last; _HuggingFaceTokenizer calls the tokenizer with its defaults (post-processor specials
included). GPT-2 BPE and HF tokenizers are built here from files written into tmp_path:
nothing is downloaded. tests/test_preprocess_upstream.py compares the datasets both systems
write with Megatron-LM's own tool.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_npu.data import DEMO_TOKENIZER_MODEL
from megatron_npu.data.preprocess import parse_args, run
from megatron_npu.data.tokenizers import (
    TokenizerError,
    TokenizerSection,
    build,
    build_tokenizer,
    pad_vocab_size,
    padded_vocab_size,
    preprocessing_encoder,
    training_tokenizer,
)

# Stable under the demo model's nmt_nfkc normalisation (single spaces, no newlines).
TEXTS = ["Hello world, this is a test.", "Return the value of x plus one.", "café naïve ✓ 42"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Return the value of x plus one.",
    "Hello world, this is a test.",
    "café naïve ✓ 42 \n\t tabs and newlines",
] * 4


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A tiny byte-level GPT-2 vocab.json + merges.txt (all 256 byte symbols, so lossless)."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()  # its trainer starts from the 256-symbol byte alphabet
    tok.train_from_iterator(
        CORPUS, vocab_size=300, min_frequency=1, show_progress=False, special_tokens=["<|endoftext|>"]
    )
    d = tmp_path_factory.mktemp("gpt2")
    vocab, merges = tok.save_model(str(d))
    return vocab, merges


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A local HF tokenizer dir: byte-level BPE whose post-processor prepends <s> (Llama-like)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", clean_up_tokenization_spaces=False
    )
    d = tmp_path_factory.mktemp("hf")
    fast.save_pretrained(str(d))
    return str(d)


SPM_KINDS = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
LEGACY = {"legacy_tokenizer": True}
# Texts on which a fast path could go wrong: whitespace runs, specials' literal text, empties.
TRICKY = ["", " ", "a  b\t\nc", "  lead and trail  ", "x<EOD>y</s>z<s>", "漢字 🙂 ünï", "\u3000wide\u00a0nbsp"]


def test_megatron_core_sentencepiece_is_the_default():
    """All three SentencePiece types: megatron-core's tokenizer, the model's own ids, eod = eos."""
    from megatron.core.tokenizers import MegatronTokenizerBase

    ids = {}
    for kind in SPM_KINDS:
        tok = build_tokenizer(kind, tokenizer_model=DEMO_TOKENIZER_MODEL)
        assert isinstance(tok, MegatronTokenizerBase), kind
        # demo_spm.model: pad=0 unk=1 bos=2 eos=3, 6000 pieces
        assert (tok.vocab_size, tok.pad, tok.bos, tok.eod, tok.eos) == (6000, 0, 2, 3, 3), kind
        ids[kind] = [tok.tokenize(t) for t in TEXTS]
        assert all(x and x[0] != tok.bos and x[-1] != tok.eod for x in ids[kind]), kind  # no BOS/EOS added
    assert ids["SentencePieceTokenizer"] == ids["GPTSentencePieceTokenizer"] == ids["Llama2Tokenizer"]


def test_preprocessing_encodes_as_megatron_core(hf_dir):
    """Preprocessing's torch-free encoders give megatron-core's ids, eod and vocabulary size."""
    corpus = [*TEXTS, *CORPUS, *TRICKY]
    for kind in SPM_KINDS:
        o = TokenizerSection(tokenizer_type=kind, tokenizer_model=DEMO_TOKENIZER_MODEL)
        core, fast = build(o), preprocessing_encoder(o)
        assert not isinstance(fast, type(core))  # the direct path, not megatron-core's object
        assert (fast.vocab_size, fast.eod) == (core.vocab_size, core.eod)
        assert [a.tolist() for a in fast.tokenize_batch_arrays(corpus)] == [core.tokenize(t) for t in corpus]
    for include in (False, True):
        o = TokenizerSection(
            tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf_dir, tokenizer_hf_include_special_tokens=include
        )
        core, fast = build(o), preprocessing_encoder(o)
        assert not isinstance(fast, type(core))
        assert (fast.vocab_size, fast.eod) == (core.vocab_size, core.eod)
        assert [a.tolist() for a in fast.tokenize_batch_arrays(corpus)] == [core.tokenize(t) for t in corpus]
    o = TokenizerSection(tokenizer_type="NullTokenizer", vocab_size=1000)
    core, fast = build(o), preprocessing_encoder(o)
    assert (fast.vocab_size, fast.eod) == (core.vocab_size, core.eod) == (1001, 1000)
    assert [a.tolist() for a in fast.tokenize_batch_arrays(["5 17 999", "0"])] == [[5, 17, 999], [0]]


def test_huggingface_direct_path_is_transformers_backend(hf_dir, tmp_path):
    """The tokenizers-only encoder holds the very backend transformers builds for megatron-core
    (same serialisation, after megatron-core's special tokens), and gives its ids; a directory
    with anything transformers acts on while loading goes through transformers instead."""
    import shutil

    from megatron_npu.data.hf_fast import _TokenizersIds, direct_encoder

    saved = json.loads((Path(hf_dir) / "tokenizer.json").read_text())["added_tokens"]
    declared = {"added_tokens_decoder": {str(t.pop("id")): t for t in saved}}  # as transformers 4 saves it
    variants = {
        "as saved": {},
        "eos as sep, bos as cls": {"sep_token": "eos_token", "cls_token": "bos_token"},
        "added tokens declared": declared,
    }
    corpus = [*TEXTS, *CORPUS, *TRICKY, "<pad><s></s> x"]
    for name, changes in variants.items():  # a string moves that key's value, anything else is set
        d = tmp_path / name.replace(" ", "-").replace(",", "")
        shutil.copytree(hf_dir, d)
        config = json.loads((d / "tokenizer_config.json").read_text())
        for key, value in changes.items():
            config[key] = config.pop(value) if isinstance(value, str) else value
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        for include in (False, True):
            o = TokenizerSection(
                tokenizer_type="HuggingFaceTokenizer",
                tokenizer_model=str(d),
                tokenizer_hf_include_special_tokens=include,
            )
            core, fast = build(o), preprocessing_encoder(o)
            assert isinstance(fast, _TokenizersIds), name
            assert fast.tok.to_str() == core._tokenizer.tokenizer.backend_tokenizer.to_str(), name
            assert (fast.vocab_size, fast.eod) == (core.vocab_size, core.eod), name
            assert [a.tolist() for a in fast.tokenize_batch_arrays(corpus)] == [core.tokenize(t) for t in corpus]
    declined = {
        "add_bos_token": {"add_bos_token": True},  # transformers rewrites the post-processor
        "model class": {"tokenizer_class": "LlamaTokenizer"},
        "new special": {"mask_token": "<mask>"},  # not in tokenizer.json: transformers adds it
        "other added token": {"added_tokens_decoder": {"2": {"content": "</s>", "lstrip": True}}},
        "unknown key": {"some_future_option": 1},
    }
    for name, change in declined.items():
        d = tmp_path / name.replace(" ", "-")
        shutil.copytree(hf_dir, d)
        config = {**json.loads((d / "tokenizer_config.json").read_text()), **change}
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        assert direct_encoder(str(d), False) is None, name
    (tmp_path / "as-saved" / "special_tokens_map.json").write_text("{}")
    assert direct_encoder(str(tmp_path / "as-saved"), False) is None


def test_padded_vocab_as_megatron_lm():
    """Megatron-LM pads its legacy tokenizer's size (global_vars builds the legacy one)."""
    for kind, size in (("SentencePieceTokenizer", 6004), ("GPTSentencePieceTokenizer", 6000)):
        for legacy in (False, True):
            o = TokenizerSection(tokenizer_type=kind, tokenizer_model=DEMO_TOKENIZER_MODEL, legacy_tokenizer=legacy)
            assert padded_vocab_size(o, build(o), 128, 1) == pad_vocab_size(size, 128, 1) == 6016
            assert padded_vocab_size(o, build(o), 128, 4) == 6144
    o = TokenizerSection(tokenizer_type="NullTokenizer", vocab_size=1000)
    assert padded_vocab_size(o, build(o), 128, 1) == 1024


def test_training_tokenizer_takes_the_tokenizer_section():
    """The trainer's tokenizer and vocabulary from its tokenizer section, the padding multiple and the TP size:
    Megatron-LM's padding unless --padded-vocab-size is given."""
    null = TokenizerSection(tokenizer_type="NullTokenizer", vocab_size=1000)
    tokenizer, padded = training_tokenizer(null, 128, 3)
    assert (tokenizer.vocab_size, padded) == (1001, 1152)  # 1001 up to a multiple of 128 x 3
    assert training_tokenizer(null.replace(padded_vocab_size=2000), 128, 3)[1] == 2000


def test_gpt_sentencepiece_legacy():
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=DEMO_TOKENIZER_MODEL, **LEGACY)
    assert (tok.vocab_size, tok.pad, tok.bos, tok.eod, tok.eos) == (6000, 0, 2, 3, 3)
    assert tok.cls == tok.sep == tok.mask == -1
    for t in TEXTS:
        ids = tok.tokenize(t)
        assert ids and ids[0] != tok.bos and ids[-1] != tok.eod  # no BOS/EOS added
        assert tok.detokenize(ids) == t
    assert tok.tokenize_batch(TEXTS) == [tok.tokenize(t) for t in TEXTS]
    assert [a.tolist() for a in tok.tokenize_batch_arrays(TEXTS)] == [tok.tokenize(t) for t in TEXTS]


def test_llama2_legacy():
    tok = build_tokenizer("Llama2Tokenizer", tokenizer_model=DEMO_TOKENIZER_MODEL, **LEGACY)
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=DEMO_TOKENIZER_MODEL, **LEGACY)
    assert (tok.vocab_size, tok.pad, tok.bos, tok.eod, tok.eos) == (6000, 0, 2, 3, 3)
    t = TEXTS[0]
    assert tok.tokenize(t) == [2, *gpt.tokenize(t)]  # bos=True, eos=False by default
    assert tok.tokenize(t, bos=False, eos=True) == [*gpt.tokenize(t), 3]
    assert tok.tokenize_batch(TEXTS) == [tok.tokenize(x) for x in TEXTS]
    assert [a.tolist() for a in tok.tokenize_batch_arrays(TEXTS)] == [tok.tokenize(x) for x in TEXTS]
    for x in TEXTS:
        assert tok.detokenize(tok.tokenize(x)) == x  # BOS is a control piece: decodes to ""


def test_sentencepiece_specials_legacy():
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=DEMO_TOKENIZER_MODEL, **LEGACY)
    # <CLS>,<SEP>,<EOD>,<MASK> appended; the model's pad/bos/eos pieces already exist
    assert (tok.vocab_size, tok.cls, tok.sep, tok.eod, tok.mask) == (6004, 6000, 6001, 6002, 6003)
    assert (tok.pad, tok.bos, tok.eos) == (0, 2, 3)
    assert tok.eod != tok.eos
    plain = tok.tokenize("Hello world")
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=DEMO_TOKENIZER_MODEL, **LEGACY)
    assert plain == gpt.tokenize("Hello world")
    ids = tok.tokenize("Hello world<EOD>more</s>x<CLS>")
    assert ids == [*plain, 6002, *gpt.tokenize("more"), 3, *gpt.tokenize("x"), 6000]
    # Megatron-LM writes each special token as " <TOKEN> "
    assert tok.detokenize(ids) == "Hello world <EOD> more </s> x <CLS> "
    mixed = ["Hello world", "a<EOD>b", "", "<MASK>"]
    assert tok.tokenize_batch(mixed) == [tok.tokenize(x) for x in mixed]
    assert [a.tolist() for a in tok.tokenize_batch_arrays(mixed)] == [tok.tokenize(x) for x in mixed]
    for t in TEXTS:
        assert tok.detokenize(tok.tokenize(t)) == t
    extra = build_tokenizer("SentencePieceTokenizer", tokenizer_model=DEMO_TOKENIZER_MODEL, vocab_extra_ids=3, **LEGACY)
    assert extra.vocab_size == 6007 and extra.tokenize("<extra_id_2>") == [6006]


def test_null_tokenizer():
    for options in ({}, LEGACY):
        tok = build_tokenizer("NullTokenizer", vocab_size=1000, **options)
        assert tok.vocab_size == 1001 and tok.eod == 1000
        assert tok.tokenize("5 17 999") == [5, 17, 999]
        assert tok.detokenize([5, 17, 1000]) == "5 17 1000"


def test_gpt2_bpe(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges, **LEGACY)
    with open(vocab, encoding="utf-8") as f:
        v = json.load(f)
    assert tok.vocab_size == len(v) and tok.eod == tok.eos == v["<|endoftext|>"]
    for t in [*TEXTS, "line one\nline  two\ttab", "ünïcødé ∑ 漢字 🙂"]:
        ids = tok.tokenize(t)
        assert tok.detokenize(ids) == t  # byte-level: lossless, no prefix space
    assert tok.tokenize_batch(TEXTS) == [tok.tokenize(t) for t in TEXTS]
    # A vocab without <|endoftext|> cannot give an eod
    del v["<|endoftext|>"]
    bad = tmp_path / "noeod.json"
    bad.write_text(json.dumps(v))
    with pytest.raises(TokenizerError, match="<\\|endoftext\\|>"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(bad), merge_file=merges, **LEGACY)
    notjson = tmp_path / "vocab.txt"
    notjson.write_text("hello 1\n")
    with pytest.raises(TokenizerError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(notjson), merge_file=merges, **LEGACY)
    with pytest.raises(TokenizerError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab)
    with pytest.raises(TokenizerError, match="--merge-file .*no such file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=str(tmp_path / "nope.txt"))


def test_huggingface(hf_dir, tmp_path):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(f"{hf_dir}/tokenizer.json")
    core = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    legacy = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir, **LEGACY)
    for tok in (core, legacy):
        assert (tok.pad, tok.bos, tok.eod) == (
            raw.token_to_id("<pad>"),
            raw.token_to_id("<s>"),
            raw.token_to_id("</s>"),
        )
        assert tok.vocab_size == raw.get_vocab_size()
    for t in [*TEXTS, "line one\nline  two"]:
        ids = legacy.tokenize(t)
        assert ids[0] == legacy.bos  # the legacy tokenizer keeps the post-processor's specials
        assert legacy.detokenize(ids[1:]) == t
        assert core.tokenize(t) == ids[1:]  # megatron-core's does not
    assert legacy.tokenize_batch(TEXTS) == [legacy.tokenize(t) for t in TEXTS]
    for options in ({}, LEGACY):
        with pytest.raises(TokenizerError, match="--tokenizer-model .*no such file"):
            build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing"), **options)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerError, match="not a local HuggingFace tokenizer"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(empty), **LEGACY)
    with pytest.raises(TokenizerError, match="HuggingFaceTokenizer: megatron-core's tokenizer could not be built"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(empty))


def test_tokenizer_errors(tmp_path):
    for kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        for options in ({}, LEGACY):
            with pytest.raises(TokenizerError, match="--tokenizer-model .*no such file"):
                build_tokenizer(kind, tokenizer_model=str(tmp_path / "missing.model"), **options)
        junk = tmp_path / "junk.model"
        junk.write_bytes(b"\x00\x01 definitely not a protobuf")
        with pytest.raises(TokenizerError, match="not a SentencePiece model"):
            build_tokenizer(kind, tokenizer_model=str(junk), **LEGACY)
        with pytest.raises(TokenizerError, match="not a SentencePiece model"):
            preprocessing_encoder(TokenizerSection(tokenizer_type=kind, tokenizer_model=str(junk)))
        with pytest.raises(TokenizerError, match=f"{kind}: megatron-core's tokenizer could not be built"):
            build_tokenizer(kind, tokenizer_model=str(junk))
    for options in ({}, LEGACY):
        with pytest.raises(TokenizerError, match="--vocab-size"):
            build_tokenizer("NullTokenizer", **options)
    with pytest.raises(TokenizerError, match="--tokenizer-type 'WordPiece'"):
        build_tokenizer("WordPiece")
    # megatron-core builds these; Megatron-LM's legacy classes for them are not in megatron-core
    with pytest.raises(TokenizerError, match="no legacy BertWordPieceCase .* drop --legacy-tokenizer"):
        build_tokenizer("BertWordPieceCase", vocab_file=DEMO_TOKENIZER_MODEL, **LEGACY)
    # The preprocessing entry point reports it in one line before any work
    from megatron_npu.data.preprocess import main

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"text": "x"}\n')
    assert (
        main(
            [
                "--input",
                str(inp),
                "--output-prefix",
                str(tmp_path / "o"),
                "--tokenizer-type",
                "Llama2Tokenizer",
                "--tokenizer-model",
                str(tmp_path / "missing.model"),
            ]
        )
        == 2
    )
    assert not list(tmp_path.glob("o_*"))


def _kinds(gpt2_files, hf_dir):
    vocab, merges = gpt2_files
    spm = ["--tokenizer-model", DEMO_TOKENIZER_MODEL]
    return {
        "SentencePieceTokenizer": spm,
        "GPTSentencePieceTokenizer": spm,
        "Llama2Tokenizer": spm,
        "HuggingFaceTokenizer": ["--tokenizer-model", hf_dir],
        "GPT2BPETokenizer": ["--vocab-file", vocab, "--merge-file", merges],
    }


def test_preprocess_round_trip_each_kind(gpt2_files, hf_dir, tmp_path):
    """preprocess -> megatron-core IndexedDataset -> detokenize gives the texts (+EOD) back."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    systems = [(kind, flags, True) for kind, flags in _kinds(gpt2_files, hf_dir).items()]
    # megatron-core's GPT2BPETokenizer fetches "gpt2" from the hub: legacy only, offline
    systems += [
        (kind, flags, False) for kind, flags in _kinds(gpt2_files, hf_dir).items() if kind != "GPT2BPETokenizer"
    ]
    for kind, flags, legacy in systems:
        prefix = tmp_path / f"{kind}-{legacy}"
        argv = ["--input", str(inp), "--output-prefix", str(prefix), "--append-eod", "--tokenizer-type", kind, *flags]
        r = run(parse_args(argv + ["--legacy-tokenizer"] * legacy))
        assert r["docs"] == len(TEXTS) and not r["problems"], kind
        options = {k.lstrip("-").replace("-", "_"): v for k, v in zip(flags[::2], flags[1::2], strict=True)}
        tok = build_tokenizer(kind, legacy_tokenizer=legacy, **options)
        ds = IndexedDataset(f"{prefix}_text_document")
        assert len(ds) == len(TEXTS) and ds.index.dtype == np.uint16, kind
        assert list(ds.sequence_lengths) == [len(tok.tokenize(t)) + 1 for t in TEXTS], kind
        for i, t in enumerate(TEXTS):
            ids = ds[i].tolist()
            assert ids[-1] == tok.eod, kind
            body = ids[:-1]
            if legacy and kind in ("Llama2Tokenizer", "HuggingFaceTokenizer"):
                assert body[0] == tok.bos, kind
                body = body[1:]
            assert tok.detokenize(body) == t, kind

    # NullTokenizer: ids in, ids out; a vocab over 65,500 switches the tokens to int32
    inp.write_text('{"text": "1 2 69999"}\n{"text": "7"}\n')
    prefix = tmp_path / "null"
    run(
        parse_args(
            [
                "--input",
                str(inp),
                "--output-prefix",
                str(prefix),
                "--append-eod",
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "70000",
            ]
        )
    )
    ds = IndexedDataset(f"{prefix}_text_document")
    assert ds.index.dtype == np.int32
    assert ds[0].tolist() == [1, 2, 69999, 70000] and ds[1].tolist() == [7, 70000]
