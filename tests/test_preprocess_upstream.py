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
- megatron-core's GPT2BPETokenizer resolves "gpt2" on the HuggingFace hub whatever
  --vocab-file says: offline only --legacy-tokenizer builds it (this project says so).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from distributed import ROOT, base_env, run
from test_data_tokenizers import gpt2_files, hf_dir  # noqa: F401  (fixtures: tiny local tokenizer files)
from test_upstream_megatron_lm import TARBALL, TARBALL_ENVVAR, env_for, megatron_lm  # noqa: F401  (fixture)

from megatron_npu.data import DEMO_CORPUS, DEMO_TOKENIZER_MODEL

pytestmark = pytest.mark.skipif(
    not TARBALL.is_file(),
    reason=f"Megatron-LM extract not found at {TARBALL} (set {TARBALL_ENVVAR} to its .tar.gz)",
)

# Megatron-LM's tool once per argv list, in one process; its failures happen in child
# processes (exit status 0), so the test checks the files each run should have written.
UPSTREAM_DRIVER = """
import json, runpy, sys
import megatron_npu  # the patch layer: Megatron-LM's megatron/training imports off CUDA
tool, configs = sys.argv[1], json.load(open(sys.argv[2]))
for argv in configs:
    sys.argv = [tool, *argv]
    runpy.run_path(tool, run_name="__main__")
"""
OURS_DRIVER = """
import json, sys
from megatron_npu.data.preprocess import main
for argv, status in json.load(open(sys.argv[1])):
    assert main(argv) == status, argv
"""
OFFLINE = {"HF_HUB_OFFLINE": "1"}  # nothing here may reach for the HuggingFace hub

EDGE_DOCS = [
    {"text": "", "title": "An empty body"},
    {"text": ["First sentence.", "", "Second sentence, after an empty one."], "title": "Sentences"},
    {"text": "Literal specials <EOD> and </s> and <s> and <pad> inline.", "title": "<MASK>"},
    {"text": "café naïve ✓ 42 \n\t tabs,  double  spaces and newlines\n", "title": "Unicode"},
    {"text": "   ", "title": ""},
]
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
    return {"text": text, "ids": ids}


def configurations(corpora: dict[str, Path], gpt2: tuple[str, str], hf: str) -> dict[str, list[str]]:
    """name -> flags (without --output-prefix); every tokenizer type, both systems."""
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
    configs["HuggingFaceTokenizer-core-include-special-tokens"] = [
        *text,
        *["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf, "--append-eod"],
        "--tokenizer-hf-include-special-tokens",
    ]
    vocab, merges = gpt2
    configs["GPT2BPETokenizer-legacy"] = [
        *text,
        *["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod"],
        *[*both_keys, "--legacy-tokenizer"],
    ]
    return configs


def compared_files(prefix: Path, flags: list[str]) -> list[str]:
    keys = flags[flags.index("--json-keys") + 1 :][:2] if "--json-keys" in flags else ["text"]
    # Megatron-LM finalizes only the last key's index (see the module docstring)
    return [f"{prefix.name}_{k}_document.bin" for k in keys] + [f"{prefix.name}_{keys[-1]}_document.idx"]


@pytest.fixture(scope="module")
def outputs(megatron_lm: Path, corpora, gpt2_files, hf_dir, tmp_path_factory) -> dict:  # noqa: F811
    """Both tools over every configuration: {name: (flags, upstream dir, our dir)}."""
    configs = configurations(corpora, gpt2_files, hf_dir)
    up, ours = tmp_path_factory.mktemp("upstream"), tmp_path_factory.mktemp("ours")
    up_argv = [[*flags, "--output-prefix", str(up / name)] for name, flags in configs.items()]
    (up / "configs.json").write_text(json.dumps(up_argv))
    job = run(
        [
            sys.executable,
            "-c",
            UPSTREAM_DRIVER,
            str(megatron_lm / "tools" / "preprocess_data.py"),
            str(up / "configs.json"),
        ],
        env={**env_for(megatron_lm), **OFFLINE},
        timeout=600,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    # this project's script itself for the first configuration, the others in one process
    first, *rest = configs
    script = run(
        [
            sys.executable,
            str(ROOT / "scripts" / "preprocess_data.py"),
            *configs[first],
            "--output-prefix",
            str(ours / first),
        ]
    )
    assert script.returncode == 0, script.stderr[-3000:]
    our_argv = [([*configs[name], "--output-prefix", str(ours / name)], 0) for name in rest]
    # megatron-core's GPT-2 BPE without the hub: refused in one line naming --legacy-tokenizer
    gpt2_core = [f for f in configs["GPT2BPETokenizer-legacy"] if f != "--legacy-tokenizer"]
    our_argv.append(([*gpt2_core, "--output-prefix", str(ours / "gpt2-core")], 2))
    (ours / "configs.json").write_text(json.dumps(our_argv))
    job = run([sys.executable, "-c", OURS_DRIVER, str(ours / "configs.json")], env=base_env(**OFFLINE))
    assert job.returncode == 0, job.stderr[-3000:]
    assert "GPT2BPETokenizer" in job.stderr and "--legacy-tokenizer" in job.stderr, job.stderr[-3000:]
    assert not list(ours.glob("gpt2-core*"))
    return {name: (flags, up, ours) for name, flags in configs.items()}


NAMES = [
    *(f"{k}-{t}" for t in ("core", "legacy") for k in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")),
    *(f"{k}-{t}" for t in ("core", "legacy") for k in ("Llama2Tokenizer", "HuggingFaceTokenizer", "NullTokenizer")),
    "SentencePieceTokenizer-core-no-eod-2-workers",
    "HuggingFaceTokenizer-core-include-special-tokens",
    "GPT2BPETokenizer-legacy",
]


@pytest.mark.parametrize("name", NAMES)
def test_same_bytes_as_megatron_lm(outputs: dict, name: str) -> None:
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
