"""scripts/preprocess_data.py writes the bytes Megatron-LM core_v0.16.1's tools/preprocess_data.py writes.

Both tools run as subprocesses on the same jsonl files and flags; every configuration's
``.bin`` and ``.idx`` are compared byte for byte (every document, every sequence length).
Megatron-LM's tool runs from the extract in ../shared/megatron-lm (the fixture of
test_upstream_megatron_lm.py) through the patch layer, all configurations inside one Python
process (``runpy`` of the unmodified tool per configuration: its imports, about 8 s, are paid
once); this project's side runs its configurations in one process too, plus one run of the
script itself.

Upstream facts these tests pin down:
- the default is megatron-core's tokenizer system: a SentencePiece model's eod is its eos id
  (the legacy ``SentencePieceTokenizer`` appends ``<EOD>`` after the vocabulary), and the
  HuggingFace tokenizer adds no post-processor specials (legacy: it does);
- a list value is sentences already split, one sequence each;
- a document whose text encodes to nothing is written as a document with no sequence;
- with several --json-keys, Megatron-LM finalizes only the last key's ``.idx`` (the others'
  ``.bin`` is complete): those ``.bin`` files and the last ``.idx`` are what is compared.
- megatron-core's GPT2BPETokenizer is ``AutoTokenizer.from_pretrained("gpt2",
  vocab_file=<--vocab-file>, merge_files=<--vocab-file again>)``: "gpt2" resolves on the
  HuggingFace hub, the vocabulary is --vocab-file's, the merges are the hub's merges.txt
  (--merge-file is never read). With HF_HUB_OFFLINE=1 it builds from a hub cache that holds
  "gpt2": the tests write one (snapshot + refs/main) from their own vocab.json/merges.txt and
  give it to both tools; with no "gpt2" cached this project refuses, naming --legacy-tokenizer.
- --split-sentences with one partition: the first run only writes the sentences to
  ``<input>_ss.jsonl`` and exits; a second run encodes that file into ``_sentence`` files.
  The splitter is ``nltk.load("nltk:tokenizers/punkt/<lang>.pickle")`` (NLTK_DATA unset),
  which nltk >= 3.9 serves from the ``punkt_tab`` model: the tests train one with nltk's
  ``PunktTrainer`` and install it under a temporary HOME's ``nltk_data``, no download.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import site
import struct
import sys
from pathlib import Path

import pytest
from distributed import ROOT, base_env, run, running
from megatron_lm_checkout import NEEDS_EXTRACT, env_for
from packaging.version import Version
from test_data_tokenizers import gpt2_files, hf_dir  # noqa: F401  (fixtures: tiny local tokenizer files)

from megatron_npu.data import DEMO_CORPUS, DEMO_TOKENIZER_MODEL

pytestmark = [
    pytest.mark.launch,
    NEEDS_EXTRACT,
]

# Megatron-LM's tool once per argv list, in one process; its failures happen in child
# processes (exit status 0), so the test checks the files each run should have written.
UPSTREAM_DRIVER = """
import glob, json, runpy, sys
import megatron_npu  # the patch layer: Megatron-LM's megatron/training imports off CUDA
tool, configs = sys.argv[1], json.load(open(sys.argv[2]))
for argv in configs:
    sys.argv = [tool, *argv]
    runpy.run_path(tool, run_name="__main__")
    prefix = argv[argv.index("--output-prefix") + 1]
    print("WROTE", len(glob.glob(prefix + "_*")), prefix, flush=True)
"""
# As `megatron-npu preprocess` runs (no patch layer at import); prints the configurations
# after which torch was imported.
OURS_DRIVER = """
import json, sys
MEGATRON_NPU_LAUNCHER = True
from megatron_npu.data.preprocess import main
for argv, status in json.load(open(sys.argv[1])):
    assert main(argv) == status, argv
    print("TORCH", "torch" in sys.modules, argv[argv.index("--output-prefix") + 1])
    print("NLTK", "nltk" in sys.modules, argv[argv.index("--output-prefix") + 1])
"""
OFFLINE = {"HF_HUB_OFFLINE": "1"}  # nothing here may reach for the HuggingFace hub
GPT2_REVISION = "0123456789abcdef0123456789abcdef01234567"  # any commit id: refs/main names it

EDGE_DOCS = [
    {"text": "", "title": "An empty body"},
    {"text": ["First sentence.", "", "Second sentence, after an empty one."], "title": "Sentences"},
    {"text": "Literal specials <EOD> and </s> and <s> and <pad> inline.", "title": "<MASK>"},
    {"text": "café naïve ✓ 42 \n\t tabs,  double  spaces and newlines\n", "title": "Unicode"},
    {"text": "   ", "title": ""},
]


def _nltk_version() -> Version | None:
    try:
        return Version(importlib.metadata.version("nltk"))
    except importlib.metadata.PackageNotFoundError:
        return None


# nltk >= 3.9 reads the punkt_tab model the tests train (older ones want a pickle)
HAVE_NLTK = (_nltk_version() or Version("0")) >= Version("3.9")
NO_NLTK = "nltk >= 3.9 is not installed (pip install nltk): --split-sentences is not compared"
NULL_DOCS = [{"text": "1 2 3 69999", "title": "7"}, {"text": ["4 5", "6"], "title": "8 9"}, {"text": "0", "title": "1"}]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Natural documents (the bundled corpus) with a title each, the edge cases, and ids for NullTokenizer."""
    d = tmp_path_factory.mktemp("corpora")
    with open(DEMO_CORPUS, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for _, line in zip(range(60), f, strict=False)]
    rows = [{"text": t, "title": t.split("\n", 1)[0][:40]} for t in docs]
    rows[10:10] = EDGE_DOCS
    text = d / "text.jsonl"
    text.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    ids = d / "ids.jsonl"
    ids.write_text("".join(json.dumps(r) + "\n" for r in NULL_DOCS))
    # --partitions globs its input and writes partition files beside it, reused by a later
    # run: one directory per configuration, a pattern the partition files do not match
    # (two files dealt round-robin; one file for the sequential case, whose order is then known)
    lines = text.read_text(encoding="utf-8").splitlines(keepends=True)
    shards = {"round-robin": {"a": lines[:25], "b": lines[25:]}, "sequential": {"a": lines}}
    for name, files in shards.items():
        (d / name).mkdir()
        for stem, part in files.items():
            (d / name / f"{stem}.jsonl").write_text("".join(part), encoding="utf-8")
    # --split-sentences writes <input>_ss.jsonl beside its input and reuses it: one directory
    # per configuration; string values only (Megatron-LM's splitter fails on a list)
    split = {}
    for name in ("split", "split-keep-newlines"):
        (d / name).mkdir()
        split[name] = d / name / "text.jsonl"
        split[name].write_text("".join(ln for ln in lines if isinstance(json.loads(ln)["text"], str)), encoding="utf-8")
    no_merges = d / "no-merges.txt"  # a GPT-2 merges file with no merge rule
    no_merges.write_text("#version: 0.2\n")
    return {
        "text": text,
        "ids": ids,
        "no-merges": no_merges,
        **{name: d / name / "[ab].jsonl" for name in shards},
        **split,
    }


@pytest.fixture(scope="module")
def punkt_home(corpora: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """A HOME whose ~/nltk_data holds an English punkt_tab model trained here by nltk's own
    PunktTrainer on the corpus (no download); None without nltk."""
    if not HAVE_NLTK:
        return None
    import nltk
    from nltk.tokenize.punkt import PunktTrainer, save_punkt_params

    home = tmp_path_factory.mktemp("home")
    texts = [json.loads(line)["text"] for line in corpora["split"].read_text(encoding="utf-8").splitlines()]
    trainer = PunktTrainer()
    trainer.train("\n\n".join(texts), finalize=True)
    data = home / "nltk_data"
    (data / "tokenizers" / "punkt_tab").mkdir(parents=True)
    nltk.data.path.append(str(data))  # nltk writes only inside its data path
    try:
        save_punkt_params(trainer.get_params(), dir=str(data / "tokenizers" / "punkt_tab" / "english"))
    finally:
        nltk.data.path.remove(str(data))
    return home


@pytest.fixture(scope="module")
def hf_home(gpt2_files: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """An HF_HOME whose hub cache holds "gpt2" as a download leaves it (the hub repo's
    config.json names the model type AutoTokenizer picks the GPT-2 tokenizer class by), its
    vocab.json and merges.txt the test's own tiny ones."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--gpt2"
    snapshot = repo / "snapshots" / GPT2_REVISION
    snapshot.mkdir(parents=True)
    vocab, merges = gpt2_files
    (snapshot / "vocab.json").write_bytes(Path(vocab).read_bytes())
    (snapshot / "merges.txt").write_bytes(Path(merges).read_bytes())
    (snapshot / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(GPT2_REVISION)
    return home


def hub_env(env: dict[str, str], home: Path) -> dict[str, str]:
    """``env`` offline with ``home`` as HF_HOME; HF_HUB_CACHE too, which would otherwise win."""
    return {**env, **OFFLINE, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub")}


def nltk_env(env: dict[str, str], home: Path | None) -> dict[str, str]:
    """``env`` with ``home`` as HOME (where nltk finds ~/nltk_data) and no NLTK_DATA (which
    would make Megatron-LM's tool load a pickle); the user site stays where it was."""
    if home is None:
        return env
    env = {k: v for k, v in env.items() if k != "NLTK_DATA"}
    return {**env, "HOME": str(home), "PYTHONUSERBASE": site.getuserbase()}


def configurations(corpora: dict[str, Path], gpt2: tuple[str, str], hf: str, split: bool) -> dict[str, list[str]]:
    """name -> flags (without --output-prefix); every tokenizer type, both systems; the
    --split-sentences ones (last: this project imports nltk only for them) when ``split``."""
    spm = ["--tokenizer-model", DEMO_TOKENIZER_MODEL]
    text = ["--input", str(corpora["text"]), "--workers", "1"]
    both_keys = ["--json-keys", "text", "title"]
    configs: dict[str, list[str]] = {}
    for legacy in ([], ["--legacy-tokenizer"]):
        tag = "legacy" if legacy else "core"
        for kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
            configs[f"{kind}-{tag}"] = [*text, "--tokenizer-type", kind, *spm, "--append-eod", *both_keys, *legacy]
        configs[f"HuggingFaceTokenizer-{tag}"] = [
            *text,
            *["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf, "--append-eod", *legacy],
        ]
        configs[f"NullTokenizer-{tag}"] = [
            *["--input", str(corpora["ids"]), "--workers", "1", "--tokenizer-type", "NullTokenizer"],
            *["--vocab-size", "70000", "--append-eod", *both_keys, *legacy],
        ]
    configs["SentencePieceTokenizer-core-no-eod-2-workers"] = [
        *["--input", str(corpora["text"]), "--workers", "2", "--tokenizer-type", "SentencePieceTokenizer", *spm],
    ]
    partitions = ["--tokenizer-type", "SentencePieceTokenizer", *spm, "--append-eod", "--partitions", "2"]
    # Megatron-LM's tool needs --workers divisible by --partitions
    configs["SentencePieceTokenizer-core-2-partitions"] = [
        *["--input", str(corpora["round-robin"]), "--workers", "2", *partitions],
    ]
    configs["SentencePieceTokenizer-core-2-partitions-keep-sequential-samples"] = [
        *["--input", str(corpora["sequential"]), "--workers", "2", *partitions, "--keep-sequential-samples"],
    ]
    configs["HuggingFaceTokenizer-core-include-special-tokens"] = [
        *text,
        *["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf, "--append-eod"],
        "--tokenizer-hf-include-special-tokens",
    ]
    vocab, merges = gpt2
    for legacy in ([], ["--legacy-tokenizer"]):
        configs[f"GPT2BPETokenizer-{'legacy' if legacy else 'core'}"] = [
            *text,
            *["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod"],
            *[*both_keys, *legacy],
        ]
    no_merges = [*text, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--append-eod"]
    configs["GPT2BPETokenizer-core-no-merges-file"] = [*no_merges, "--merge-file", str(corpora["no-merges"])]
    if split:
        # byte-level BPE keeps whitespace, so --keep-newlines shows in the ids (SentencePiece
        # normalises the newlines away)
        sentences = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf, "--append-eod"]
        sentences += [*both_keys, "--split-sentences"]
        configs["HuggingFaceTokenizer-core-split-sentences"] = [
            *["--input", str(corpora["split"]), "--workers", "1", *sentences],
        ]
        configs["HuggingFaceTokenizer-core-split-sentences-keep-newlines-2-workers"] = [
            *["--input", str(corpora["split-keep-newlines"]), "--workers", "2", *sentences, "--keep-newlines"],
        ]
    return configs


def compared_files(prefix: Path, flags: list[str]) -> list[str]:
    keys = flags[flags.index("--json-keys") + 1 :][:2] if "--json-keys" in flags else ["text"]
    level = "sentence" if "--split-sentences" in flags else "document"
    # Megatron-LM finalizes only the last key's index (see the module docstring)
    return [f"{prefix.name}_{k}_{level}.bin" for k in keys] + [f"{prefix.name}_{keys[-1]}_{level}.idx"]


@pytest.fixture(scope="module")
def outputs(megatron_lm: Path, corpora, gpt2_files, hf_dir, punkt_home, hf_home, tmp_path_factory) -> dict:  # noqa: F811
    """Both tools over every configuration: {name: (flags, upstream dir, our dir)}."""
    configs = configurations(corpora, gpt2_files, hf_dir, split=punkt_home is not None)
    up, ours = tmp_path_factory.mktemp("upstream"), tmp_path_factory.mktemp("ours")
    # megatron-core's GPT-2 BPE offline with no "gpt2" cached: refused in one line naming
    # --legacy-tokenizer (its own process, for its own hub cache: alongside the others)
    refused = [([*configs["GPT2BPETokenizer-core"], "--output-prefix", str(ours / "gpt2-refused")], 2)]
    (ours / "refused.json").write_text(json.dumps(refused))
    no_gpt2 = hub_env(base_env(), tmp_path_factory.mktemp("hf_home_without_gpt2"))
    driver = [sys.executable, "-c", OURS_DRIVER, str(ours / "refused.json")]
    with running(driver, env=no_gpt2, timeout_s=600) as refusal:
        up_argv = [[*flags, "--output-prefix", str(up / name)] for name, flags in configs.items()]
        # as a user would: --split-sentences is run a second time to encode what the first split
        up_argv += [argv for argv in up_argv if "--split-sentences" in argv]
        (up / "configs.json").write_text(json.dumps(up_argv))
        job = run(
            [
                sys.executable,
                "-c",
                UPSTREAM_DRIVER,
                str(megatron_lm / "tools" / "preprocess_data.py"),
                str(up / "configs.json"),
            ],
            env=nltk_env(hub_env(env_for(megatron_lm), hf_home), punkt_home),
            timeout=600,
        )
        assert job.returncode == 0, job.stderr[-3000:]
        wrote = [(Path(prefix).name, int(n)) for n, prefix in re.findall(r"^WROTE (\d+) (.*)$", job.stdout, re.M)]
        # this project's script itself for the first configuration, the others in one process
        first, *rest = configs
        script = run(
            [
                *[sys.executable, "-X", "importtime"],  # the script starts without torch
                str(ROOT / "scripts" / "preprocess_data.py"),
                *configs[first],
                "--output-prefix",
                str(ours / first),
            ]
        )
        assert script.returncode == 0, script.stderr[-3000:]
        assert not re.search(r"\| torch$", script.stderr, re.M), "scripts/preprocess_data.py imported torch"
        our_argv = [([*configs[name], "--output-prefix", str(ours / name)], 0) for name in rest]
        (ours / "configs.json").write_text(json.dumps(our_argv))
        job = run(
            [sys.executable, "-c", OURS_DRIVER, str(ours / "configs.json")],
            env=nltk_env(hub_env(base_env(), hf_home), punkt_home),
        )
        assert job.returncode == 0, job.stderr[-3000:]
        # nltk (a second of imports) only for --split-sentences
        nltk_after = {
            Path(prefix).name: flag == "True" for flag, prefix in re.findall(r"^NLTK (\w+) (.*)$", job.stdout, re.M)
        }
        imported_nltk = {name for name, imported in nltk_after.items() if imported and name in configs}
        assert imported_nltk == {name for name in configs if "split" in name}
        # SentencePiece, HuggingFace (tokenizer.json read by the tokenizers library) and null
        # tokenizers encode without torch: neither megatron-core nor transformers is imported
        rows = [line.split()[1:] for line in job.stdout.splitlines() if line.startswith("TORCH ")]
        torch_after = {Path(prefix).name: flag == "True" for flag, prefix in rows}
        for name in ("GPTSentencePieceTokenizer-core", "Llama2Tokenizer-core", "HuggingFaceTokenizer-core"):
            assert not torch_after[name], f"{name} imported torch"
        assert refusal.process.wait(timeout=refusal.timeout_s) == 0, refusal.log()[-3000:]
        refusal_log = refusal.log()
    assert "GPT2BPETokenizer" in refusal_log and "--legacy-tokenizer" in refusal_log, refusal_log[-3000:]
    assert not list(ours.glob("gpt2-refused*"))
    return {"wrote": wrote, **{name: (flags, up, ours) for name, flags in configs.items()}}


NAMES = [
    *(f"{k}-{t}" for t in ("core", "legacy") for k in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")),
    *(f"{k}-{t}" for t in ("core", "legacy") for k in ("Llama2Tokenizer", "HuggingFaceTokenizer", "NullTokenizer")),
    "SentencePieceTokenizer-core-no-eod-2-workers",
    "SentencePieceTokenizer-core-2-partitions",
    "SentencePieceTokenizer-core-2-partitions-keep-sequential-samples",
    "HuggingFaceTokenizer-core-include-special-tokens",
    "GPT2BPETokenizer-core",
    "GPT2BPETokenizer-core-no-merges-file",
    "GPT2BPETokenizer-legacy",
    "HuggingFaceTokenizer-core-split-sentences",
    "HuggingFaceTokenizer-core-split-sentences-keep-newlines-2-workers",
]


@pytest.mark.parametrize("name", NAMES)
def test_same_bytes_as_megatron_lm(outputs: dict, name: str) -> None:
    if "split" in name and not HAVE_NLTK:
        pytest.skip(NO_NLTK)
    flags, up, ours = outputs[name]
    files = compared_files(up / name, flags)
    missing = [f for f in files if not (up / f).is_file()]
    assert not missing, f"Megatron-LM wrote no {missing} for {name}"
    for f in files:
        assert (ours / f).read_bytes() == (up / f).read_bytes(), f"{name}: {f} differs from Megatron-LM's"
    # every key's index is written here (Megatron-LM's tool leaves all but the last one out)
    for f in files:
        assert (ours / f.replace(".bin", ".idx")).is_file()


def test_the_systems_differ_where_megatron_lm_says(outputs: dict) -> None:
    """Not vacuous: the default and --legacy-tokenizer give different ids for these two types."""
    for kind in ("SentencePieceTokenizer", "HuggingFaceTokenizer"):
        _, up, _ = outputs[f"{kind}-core"]
        core = (up / f"{kind}-core_text_document.bin").read_bytes()
        legacy = (up / f"{kind}-legacy_text_document.bin").read_bytes()
        assert core != legacy, kind


def test_core_gpt2_merges_come_from_the_hub_cache(outputs: dict, corpora: dict[str, Path]) -> None:
    """megatron-core's GPT2BPETokenizer never reads --merge-file: one with no merge rule gives
    the same ids, merged ones (byte-level ids without merges would outnumber the UTF-8 bytes)."""
    _, up, _ = outputs["GPT2BPETokenizer-core"]
    core = (up / "GPT2BPETokenizer-core_text_document.bin").read_bytes()
    assert (up / "GPT2BPETokenizer-core-no-merges-file_text_document.bin").read_bytes() == core
    docs = [json.loads(line)["text"] for line in corpora["text"].read_text(encoding="utf-8").splitlines()]
    utf8 = sum(len("".join(t).encode()) for t in docs)  # a list value: its sentences
    assert len(core) // 2 < utf8  # uint16 ids (a 300-symbol vocabulary)


def test_partitions_order_documents_as_megatron_lm(outputs: dict) -> None:
    """Not vacuous: two partitions deal the lines round-robin (partition 0's documents first);
    --keep-sequential-samples keeps the input order, the bytes of one partition."""
    _, up, ours = outputs["SentencePieceTokenizer-core"]
    whole = (ours / "SentencePieceTokenizer-core_text_document.bin").read_bytes()
    dealt = (ours / "SentencePieceTokenizer-core-2-partitions_text_document.bin").read_bytes()
    kept = (ours / "SentencePieceTokenizer-core-2-partitions-keep-sequential-samples_text_document.bin").read_bytes()
    assert kept == whole and dealt != whole and sorted(dealt) == sorted(whole)


def _counts(idx: Path) -> tuple[int, int]:
    """(sequences, documents) from a Megatron .idx header: magic, version, dtype code, counts."""
    return struct.unpack_from("<QQ", idx.read_bytes(), 9 + 8 + 1)


@pytest.mark.skipif(not HAVE_NLTK, reason=NO_NLTK)
def test_split_sentences_as_megatron_lm(outputs: dict, corpora: dict[str, Path]) -> None:
    """Not vacuous: the documents are split into several sentences each, --keep-newlines
    splits differently, and Megatron-LM's first run with one partition only writes the
    ``_ss`` file (so its user runs it twice, as the fixture does)."""
    name = "HuggingFaceTokenizer-core-split-sentences"
    kept = f"{name}-keep-newlines-2-workers"
    _, up, ours = outputs[name]
    sentences, documents = _counts(ours / f"{name}_text_sentence.idx")
    assert sentences > 2 * documents
    split = (ours / f"{name}_text_sentence.bin").read_bytes()
    assert split != (ours / f"{kept}_text_sentence.bin").read_bytes()
    runs = [n for prefix, n in outputs["wrote"] if prefix == name]
    assert runs[0] == 0 and runs[1] > 0, outputs["wrote"]
    assert corpora["split"].with_name("text_ss.jsonl").is_file()
