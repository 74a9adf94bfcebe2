"""Megatron-LM core_v0.16.1's own pretrain_gpt.py trains the model families its recipes describe, on the patch layer.

The recipes are Megatron-LM's own (examples/post_training/modelopt/conf/<org>/<model>.sh, MODEL_ARGS, unmodified
in ../shared/megatron-lm/): each family's every architecture flag is kept and only the sizes shrink (a few layers,
hidden 64, 8 experts, sequence 64); what names the Hugging Face hub (tokenizer, vocabulary padding) or needs
ModelOpt (``--export-*``: ModelOpt's parser adds them; ``--enable-gpt-oss``: parsed, acting only in ModelOpt's
builder) is left out. Each family trains
3 iterations through ``torchrun -m megatron_npu.run pretrain_gpt.py --transformer-impl local``:
- DeepSeek-V2-Lite: multi-latent attention with YaRN, ``--moe-grouped-gemm`` (megatron-core's legacy GroupedMLP on
  the project's grouped GEMM), shared experts, a dense first layer, sequence-level aux loss;
- DeepSeek-R1 (Kimi-K2 has the same attention and router flags but the groups) + ``--mtp-num-layers 1``: MLA with a
  query LoRA, sigmoid group-limited routing with expert bias, recompute, multi-token prediction;
- gpt-oss-20b: sliding-window and sink (learnable softmax) attention, quick-GeGLU with clamp and offset, biased
  experts;
- Qwen3-30B-A3B under TP2 x EP2 with sequence parallelism (4 ranks).
"""

from __future__ import annotations

import math
import re
import shlex
import tarfile
from pathlib import Path

import pytest
from distributed import ROOT, Job
from megatron_lm_checkout import TARBALL, upstream

RECIPES = ROOT.parent / "shared" / "megatron-lm" / "megatron-lm-core_v0.16.1-model-recipes.tar.gz"
CONF = "examples/post_training/modelopt/conf"

pytestmark = [
    pytest.mark.launch,
    pytest.mark.skipif(
        not (TARBALL.is_file() and RECIPES.is_file()), reason=f"Megatron-LM extracts not found beside {TARBALL}"
    ),
]

#: What names the Hugging Face hub or needs ModelOpt's parser (not installed): left out, with its value.
LEFT_OUT = {
    "--save-interval",
    "--tokenizer-type",
    "--make-vocab-size-divisible-by",
    "--padded-vocab-size",
    "--trust-remote-code",
    "--export-force-local-attention",
    "--enable-gpt-oss",
}
#: The sizes, scaled down (group-limited routing keeps its shape: 8 experts in 4 groups, 2 of them picked).
SIZES = {
    "--num-layers": "3",
    "--moe-layer-freq": "[0]*1+[1]*2",  # the recipes' dense-first pattern, on 3 layers
    "--hidden-size": "64",
    "--ffn-hidden-size": "128",
    "--num-attention-heads": "4",
    "--num-query-groups": "2",
    "--kv-channels": "16",
    "--kv-lora-rank": "32",
    "--q-lora-rank": "48",
    "--qk-head-dim": "16",
    "--qk-pos-emb-head-dim": "8",
    "--v-head-dim": "16",
    "--num-experts": "8",
    "--moe-ffn-hidden-size": "32",
    "--moe-shared-expert-intermediate-size": "32",
    "--moe-router-topk": "2",
    "--moe-router-num-groups": "4",
    "--moe-router-group-topk": "2",
    "--seq-length": "64",
    "--max-position-embeddings": "64",
    "--window-size": "16,0",
}
RUN = (
    "--transformer-impl local --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --global-batch-size 4 "
    "--train-iters 3 --lr 1e-3 --seed 1234 --log-interval 1 --eval-iters 0 --eval-interval 1000 --num-workers 0"
).split()
ITERATIONS = [1, 2, 3]

FAMILIES = {
    "DeepSeek-V2-Lite": ("deepseek-ai/DeepSeek-V2-Lite.sh", (), 1),
    "DeepSeek-R1+MTP": ("deepseek-ai/DeepSeek-R1.sh", ("--mtp-num-layers", "1"), 1),
    "gpt-oss-20b": ("openai/gpt-oss-20b.sh", (), 1),
    "Qwen3-30B-A3B TP2xEP2": (
        "Qwen/Qwen3-30B-A3B.sh",
        ("--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"),
        4,
    ),
}
#: megatron-core's name in the iteration line for each --moe-router-load-balancing-type
AUX_LOSS_LINE = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
ITERATION_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|(.*)")
VALUE = re.compile(r"([A-Za-z0-9_ ]+?):\s+([0-9.Ee+-]+|nan|inf) \|")


def recipe_flags(archive: tarfile.TarFile, name: str) -> list[str]:
    """The recipe's MODEL_ARGS, its sizes scaled down and what needs the hub left out."""
    [member] = [m for m in archive.getmembers() if m.name.removeprefix("./") == f"{CONF}/{name}"]
    text = archive.extractfile(member).read().decode()
    [model_args] = re.findall(r'MODEL_ARGS="(.*?)"', text, re.S)
    flags: list[str] = []
    replaced = False  # inside a flag whose value SIZES gives
    for token in shlex.split(model_args.replace("\\\n", " ")):
        if token.startswith("--"):
            replaced = token in SIZES
            flags += [token, SIZES[token]] if replaced else [token]
        elif not replaced:
            flags.append(token)
    return _without(flags, LEFT_OUT)


def _without(flags: list[str], names: set[str]) -> list[str]:
    kept, skipping = [], False
    for token in flags:
        if token.startswith("--"):
            skipping = token in names
        if not skipping:
            kept.append(token)
    return kept


def logged(job: Job) -> dict[int, dict[str, float]]:
    """Each iteration line's values (``lm loss``, ``mtp_1 loss``, aux losses, ...) by iteration."""
    found = {}
    for line in job.stdout.splitlines():
        match = ITERATION_LINE.search(line)
        if match:
            found[int(match.group(1))] = {k.strip(): float(v) for k, v in VALUE.findall(match.group(2) + " |")}
    return found


@pytest.fixture(scope="module")
def families(megatron_lm: Path) -> dict[str, tuple[list[str], Job]]:
    """One launch per family (every test below reads them): its flags and its job."""
    runs = {}
    with tarfile.open(RECIPES) as archive:
        for family, (recipe, extra, nproc) in FAMILIES.items():
            flags = [*recipe_flags(archive, recipe), *extra]
            runs[family] = flags, upstream(megatron_lm, *flags, *RUN, nproc=nproc)
    return runs


def test_the_recipes_keep_their_architecture_flags(families):
    flags = {family: set(run[0]) for family, run in families.items()}
    assert {"--multi-latent-attention", "--moe-grouped-gemm", "--rotary-scaling-factor"} <= flags["DeepSeek-V2-Lite"]
    assert {"--q-lora-rank", "--moe-router-enable-expert-bias", "--mtp-num-layers"} <= flags["DeepSeek-R1+MTP"]
    assert {"--moe-router-num-groups", "--recompute-activations", "--moe-shared-expert-overlap"} <= flags[
        "DeepSeek-R1+MTP"
    ]
    assert {"--quick-geglu", "--softmax-type", "--window-size", "--activation-func-clamp-value"} <= flags["gpt-oss-20b"]
    assert {"--qk-layernorm", "--sequence-parallel"} <= flags["Qwen3-30B-A3B TP2xEP2"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_trains(families, family):
    flags, job = families[family]
    job.check()
    lines = logged(job)
    assert sorted(lines) == ITERATIONS, job.stdout[-3000:]
    losses = [lines[i]["lm loss"] for i in ITERATIONS]
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < losses[0], losses  # 3 steps at lr 1e-3 on mock data: falling
    assert all(lines[i]["number of nan iterations"] == 0 for i in ITERATIONS)
    if "--moe-aux-loss-coeff" in flags and flags[flags.index("--moe-aux-loss-coeff") + 1] != "0.0":
        kind = flags[flags.index("--moe-router-load-balancing-type") + 1]
        assert all(math.isfinite(lines[i][AUX_LOSS_LINE[kind]]) for i in ITERATIONS)


def test_multi_token_prediction_logs_its_loss(families):
    _, job = families["DeepSeek-R1+MTP"]
    lines = logged(job)
    mtp = [lines[i].get("mtp_1 loss") for i in ITERATIONS]
    assert all(value is not None and math.isfinite(value) for value in mtp), job.stdout[-2000:]
