"""The bundled demo dataset and megatron-core's own readers on our preprocessing output.

megatron-core 0.16's BlendedDataset calls torch.distributed.get_rank() unguarded when it
has a path_to_cache (as training runs do), so the builder test runs inside a 1-rank gloo
process group created in this process and destroyed afterwards (no torchrun).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_npu.data import DEMO_CORPUS, DEMO_TOKENIZER_MODEL, ensure_demo_dataset
from megatron_npu.data.preprocess import main, parse_args, run
from megatron_npu.data.tokenizers import build_tokenizer

SEQ = 64


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=DEMO_TOKENIZER_MODEL)


def _texts() -> list[str]:
    with open(DEMO_CORPUS, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def test_demo_dataset(tmp_path, tok):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = ensure_demo_dataset(str(tmp_path))
    assert prefix == str(tmp_path / "demo_text_document")
    idx = tmp_path / "demo_text_document.idx"
    mtime = idx.stat().st_mtime_ns
    assert ensure_demo_dataset(str(tmp_path)) == prefix and idx.stat().st_mtime_ns == mtime  # reused
    texts = _texts()
    ds = IndexedDataset(prefix)
    assert len(ds) == len(texts) and ds.index.dtype == np.uint16
    for i in (0, 1, 2, len(texts) // 2, len(texts) - 1):
        assert ds[i].tolist() == tok.tokenize(texts[i]) + [tok.eod]
    assert int(ds.sequence_lengths.sum()) == sum(len(tok.tokenize(t)) + 1 for t in texts)
    assert not list(tmp_path.glob("*.tmp"))  # nothing half-written left aside


@pytest.fixture()
def one_rank_group():
    import socket

    import torch.distributed as dist

    assert not dist.is_initialized()
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _aligned_find(hay: bytes, needle: bytes, itemsize: int) -> bool:
    start = hay.find(needle)
    while start >= 0:
        if start % itemsize == 0:
            return True
        start = hay.find(needle, start + 1)
    return False


def test_blended_builder_two_prefixes(tmp_path, tok, one_rank_group):
    import torch
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    lines = [ln for ln in open(DEMO_CORPUS, encoding="utf-8") if ln.strip()]
    half = len(lines) // 2
    prefixes = []
    for name, part in (("a", lines[:half]), ("b", lines[half:])):
        inp = tmp_path / f"{name}.jsonl"
        inp.write_text("".join(part), encoding="utf-8")
        r = run(
            parse_args(
                [
                    "--input",
                    str(inp),
                    "--output-prefix",
                    str(tmp_path / name),
                    "--append-eod",
                    "--tokenizer-type",
                    "GPTSentencePieceTokenizer",
                    "--tokenizer-model",
                    DEMO_TOKENIZER_MODEL,
                ]
            )
        )
        assert r["docs"] == len(part) and not r["problems"]
        prefixes.append(str(tmp_path / f"{name}_text_document"))

    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=SEQ,
        blend=(prefixes, [0.3, 0.7]),
        split="90,5,5",
        path_to_cache=str(tmp_path / "cache"),
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mmap_bin_files=True,
    )
    sizes = [200, 20, 20]
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    assert list((tmp_path / "cache").glob("*.npy"))  # indices cached as in a training run

    streams = [IndexedDataset(p) for p in prefixes]
    hay = [np.concatenate([s[i] for i in range(len(s))]).astype(np.uint16).tobytes() for s in streams]
    for ds, n in ((train, 200), (valid, 20), (test, 20)):
        assert isinstance(ds, BlendedDataset) and len(ds) >= n
        seen = set()
        for i in range(n):
            s = ds[i]
            tokens, labels = s["tokens"], s["labels"]
            assert tokens.shape == (SEQ,) and labels.shape == (SEQ,)
            assert torch.equal(tokens[1:], labels[:-1])  # labels are the next tokens
            text = torch.cat([tokens, labels[-1:]]).numpy().astype(np.uint16)  # seq_length + 1
            d = int(s["dataset_id"])
            seen.add(d)
            # Documents are shuffled, so a sample is a run of whole/partial documents: each
            # EOD-terminated piece is verbatim in its own prefix (pad id 0 never occurs in data).
            cut = [0, *(np.flatnonzero(text == tok.eod) + 1).tolist(), len(text)]
            for a, b in zip(cut[:-1], cut[1:], strict=True):
                if b > a:
                    assert _aligned_find(hay[d], text[a:b].tobytes(), 2), (i, d, a, b)
        assert seen == {0, 1}
    # ~30/70 weights: the blend draws from both in roughly that proportion
    ids = np.array([int(train[i]["dataset_id"]) for i in range(200)])
    assert 0.2 < (ids == 0).mean() < 0.4


def test_split_sentences_is_a_clear_error(tmp_path, capsys):
    try:
        import nltk  # noqa: F401

        has_nltk = True
    except ImportError:
        has_nltk = False
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"text": "One. Two."}\n')
    rc = main(
        [
            "--input",
            str(inp),
            "--output-prefix",
            str(tmp_path / "o"),
            "--split-sentences",
            "--tokenizer-type",
            "GPTSentencePieceTokenizer",
            "--tokenizer-model",
            DEMO_TOKENIZER_MODEL,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "--split-sentences" in err and len(err.strip().splitlines()) == 1
    if not has_nltk:
        assert "pip install nltk" in err
    assert not list(tmp_path.glob("o_*"))


def test_worker_results_are_bounded():
    """--workers > 1 keeps at most a fixed window of batches in flight (flat memory)."""
    from megatron_npu.data.preprocess import _bounded_imap

    class Done:
        def __init__(self, v):
            self.v = v

        def get(self):
            return self.v

    class FakePool:
        submitted = 0

        def apply_async(self, fn, args):
            self.submitted += 1
            return Done(fn(*args))

    pool = FakePool()
    consumed = 0
    for v in _bounded_imap(pool, lambda x: x * 2, iter(range(1000)), window=8):
        assert v == consumed * 2  # in order
        consumed += 1
        assert pool.submitted - consumed <= 7
    assert consumed == 1000
