"""A dataset from another tokenizer than the trainer's is refused at start-up, in one message.

The datasets are written by scripts/preprocess_data.py (whose bytes equal Megatron-LM's tool,
tests/test_preprocess_upstream.py) from the bundled corpus.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pretrain_runs import MODEL

from megatron_npu.data import DEMO_CORPUS, DEMO_TOKENIZER_MODEL
from megatron_npu.data.dataset_check import mismatch
from megatron_npu.data.preprocess import parse_args, run
from megatron_npu.data.tokenizers import TokenizerError, build_tokenizer

SPM = ["--tokenizer-model", DEMO_TOKENIZER_MODEL]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("datasets")
    corpus = d / "corpus.jsonl"
    with open(DEMO_CORPUS, encoding="utf-8") as f:
        corpus.write_text("".join(line for _, line in zip(range(100), f, strict=False)), encoding="utf-8")
    ids = d / "ids.jsonl"
    ids.write_text("".join(json.dumps({"text": f"{i} {i + 1} 69999"}) + "\n" for i in range(20)))
    runs = {
        "legacy-sp": ["--tokenizer-type", "SentencePieceTokenizer", *SPM, "--append-eod", "--legacy-tokenizer"],
        "core-sp": ["--tokenizer-type", "SentencePieceTokenizer", *SPM, "--append-eod"],
        "core-sp-no-eod": ["--tokenizer-type", "SentencePieceTokenizer", *SPM],
        "null-70000": ["--tokenizer-type", "NullTokenizer", "--vocab-size", "70000", "--append-eod"],
    }
    out = {}
    for name, flags in runs.items():
        source = ids if name.startswith("null") else corpus
        run(parse_args(["--input", str(source), "--output-prefix", str(d / name), *flags]))
        out[name] = str(d / f"{name}_text_document")
    return out


def test_the_tokenizer_a_dataset_was_written_with_passes(datasets):
    core = build_tokenizer("SentencePieceTokenizer", tokenizer_model=DEMO_TOKENIZER_MODEL)
    legacy = build_tokenizer("SentencePieceTokenizer", tokenizer_model=DEMO_TOKENIZER_MODEL, legacy_tokenizer=True)
    assert mismatch(datasets["core-sp"], core) is None
    assert mismatch(datasets["legacy-sp"], legacy) is None
    # documents without an eod end in ordinary tokens: nothing to say about the eod
    assert mismatch(datasets["core-sp-no-eod"], core) is None
    assert mismatch(datasets["core-sp-no-eod"], legacy) is None
    null = build_tokenizer("NullTokenizer", vocab_size=70000)
    assert mismatch(datasets["null-70000"], null) is None


def test_each_mismatch_is_named(datasets):
    core = build_tokenizer("SentencePieceTokenizer", tokenizer_model=DEMO_TOKENIZER_MODEL)
    legacy = build_tokenizer("SentencePieceTokenizer", tokenizer_model=DEMO_TOKENIZER_MODEL, legacy_tokenizer=True)
    # legacy data (eod <EOD> = 6002, after the model's 6000 pieces) read with megatron-core's tokenizer
    assert mismatch(datasets["legacy-sp"], core) == "it holds token id 6002, past this tokenizer's 6000 ids"
    # megatron-core's data (eod = eos = 3) read with the legacy tokenizer (eod 6002)
    assert (
        mismatch(datasets["core-sp"], legacy)
        == "its documents end with id 3, this tokenizer's eos, while its eod is 6002"
    )
    # int32 tokens come from a vocabulary of 65,500 ids or more
    assert mismatch(datasets["null-70000"], core) == "its tokens are int32, a tokenizer of 6000 ids writes uint16"
    small_null = build_tokenizer("NullTokenizer", vocab_size=1000)
    problem = mismatch(datasets["core-sp"], small_null)
    assert problem.startswith("it holds token id ") and problem.endswith("past this tokenizer's 1001 ids")


def test_the_trainer_refuses_it_before_any_work(datasets):
    """pretrain_gpt.py's start-up (setup_args): one TokenizerError naming the flag, the prefix and the fix."""
    from megatron_npu.training.loop import setup_args

    flags = [*MODEL, "--train-iters", "3", "--split", "1,0,0", "--tokenizer-type", "SentencePieceTokenizer", *SPM]
    with pytest.raises(TokenizerError) as error:
        setup_args([*flags, "--data-path", "1.0", datasets["legacy-sp"]], None)
    message = str(error.value)
    assert message.startswith(f"--data-path {datasets['legacy-sp']}: it holds token id 6002")
    assert "--legacy-tokenizer" in message
    args, tokenizer = setup_args([*flags, "--data-path", datasets["legacy-sp"], "--legacy-tokenizer"], None)
    assert tokenizer.eod == 6002 and args.padded_vocab_size == 6016
    args, tokenizer = setup_args([*flags, "--data-path", datasets["core-sp"]], None)
    assert tokenizer.eod == 3 and args.padded_vocab_size == 6016  # Megatron-LM pads the legacy size (6004)
    assert Path(datasets["core-sp"] + ".bin").is_file()
