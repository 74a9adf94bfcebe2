"""The word cache gives exactly sp.encode's ids, on the corpus, on hostile text, and on models
where it must step aside."""

from __future__ import annotations

import json
import random

import pytest

sentencepiece = pytest.importorskip("sentencepiece")

from megatron_npu.data import DEMO_CORPUS, DEMO_TOKENIZER_MODEL  # noqa: E402
from megatron_npu.data.word_cache import WordCachedEncoder, python_whitespace  # noqa: E402


def _texts() -> list[str]:
    with open(DEMO_CORPUS, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def _batched(enc: WordCachedEncoder, texts: list[str], size: int) -> list[list[int]]:
    out: list[list[int]] = []
    for i in range(0, len(texts), size):
        out.extend(enc(texts[i : i + size]))
    return out


@pytest.fixture(scope="module")
def sp():
    return sentencepiece.SentencePieceProcessor(model_file=DEMO_TOKENIZER_MODEL)


def test_corpus_cold_and_warm_equal_sentencepiece(sp):
    texts = _texts()
    ref = sp.encode(texts)
    enc = WordCachedEncoder(sp)
    assert enc.exact
    assert _batched(enc, texts, 256) == ref  # cold: every word new once
    assert _batched(enc, texts, 100) == ref  # warm: all lookups
    assert enc.misses == len(enc.cache) and enc.hits > 10 * enc.misses


def test_hostile_text_equals_sentencepiece(sp):
    # Every whitespace Python knows, combining marks, NFKC-folded forms (ligature, fullwidth,
    # fractions, squared units), the literal whitespace mark, CJK, emoji, controls, tags.
    alphabet = (
        list(python_whitespace()) * 3
        + list("abcXYZ019.,;-_'\"()")
        + [
            "\u0301",
            "\u0308",
            "e\u0301",
            "\ufb01",
            "\uff21\uff42",
            "\u00bd",
            "\u338f",
            "\u2581",
            "\u200b",
            "\u00ad",
            "\u4e2d\u6587",
            "\U0001f600",
            "\x00",
            "\x07",
            "\ufeff",
            "<s>",
            "</s>",
            "\u0e01",
            "\u05d0",
        ]
    )
    rng = random.Random(0)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40))) for _ in range(4000)]
    enc = WordCachedEncoder(sp)
    assert _batched(enc, texts, 64) == sp.encode(texts)
    assert _batched(enc, texts, 64) == sp.encode(texts)


def test_bounded_cache_stays_exact(sp):
    texts = _texts()[:200]
    enc = WordCachedEncoder(sp, max_words=300)
    assert _batched(enc, texts, 8) == sp.encode(texts)
    biggest_batch = max(len({w for t in texts[i : i + 8] for w in t.split()}) for i in range(0, 200, 8))
    assert len(enc.cache) <= max(300, biggest_batch)


@pytest.mark.parametrize("how", ["split_by_whitespace=False", "identity normalizer, spaces kept"])
def test_models_that_do_not_decompose_fall_back(tmp_path, how):
    texts = _texts()[:150]
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(t.replace("\n", " ") for t in texts), encoding="utf-8")
    opts = (
        dict(split_by_whitespace=False)
        if how.startswith("split")
        else dict(normalization_rule_name="identity", remove_extra_whitespaces=False)
    )
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "m"),
        vocab_size=800,
        model_type="bpe",
        minloglevel=2,
        num_threads=1,
        **opts,
    )
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "m.model"))
    enc = WordCachedEncoder(sp)
    assert not enc.exact
    assert enc(texts) == sp.encode(texts)
