"""examples/: one launch recipe per model family, checked as a user runs them.

* ``--dry-run`` (no process): each recipe prints every node's environment and pretrain_gpt.py command at
  its full size and layout, and the trainer's own parser and validation accept that command for the
  recipe's world size (what ``megatron-npu plan`` reads too).
* scaled down (one torchrun job per recipe, on the cpu target): the same script and flags with tiny
  sizes and a 2-rank layout through its documented environment variables, 2 iterations.
* the header's figures (no process): the predicted memory per card each header states is what ``plan``
  predicts for the recipe's default layout and flags (read from the script's text; the dry-run test checks
  they are the flags the script runs), and that layout fits the card; its tokens/s per NPU and MFU are the
  step-time model's for that layout, as ``plan`` prints them; so the headers cannot go stale.
"""

from __future__ import annotations

import argparse
import ast
import functools
import operator
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
RECIPES = sorted(p.stem for p in EXAMPLES.glob("*.sh"))
TINY = {
    "NUM_LAYERS": "2",
    "HIDDEN_SIZE": "64",
    "NUM_ATTENTION_HEADS": "4",
    "NUM_QUERY_GROUPS": "2",
    "KV_CHANNELS": "16",
    "FFN_HIDDEN_SIZE": "128",
    "SEQ_LENGTH": "64",
    "GLOBAL_BATCH_SIZE": "4",
    "MICRO_BATCH_SIZE": "1",
    "NUM_EXPERTS": "4",
    "MOE_ROUTER_TOPK": "2",
    "MOE_FFN_HIDDEN_SIZE": "32",
    "Q_LORA_RANK": "32",
    "KV_LORA_RANK": "16",
    "QK_HEAD_DIM": "16",
    "QK_POS_EMB_HEAD_DIM": "8",
    "V_HEAD_DIM": "16",
    "DENSE_LAYERS": "1",
    "WINDOW": "16",
    "FIRST_STAGE_LAYERS": "",  # even stages unless the 2-rank layout below sets them
    "LAST_STAGE_LAYERS": "",
}
# each recipe's layout on 2 ranks (its other flags unchanged)
TWO_RANKS = {
    "deepseek_v3": {
        "TP": "1",
        "PP": "2",
        "EP": "1",
        "NUM_LAYERS": "3",
        "FIRST_STAGE_LAYERS": "1",
        "LAST_STAGE_LAYERS": "2",
    },
    "llama31_70b_4nodes": {
        "TP": "1",
        "PP": "2",
        "NUM_LAYERS": "4",
        "FIRST_STAGE_LAYERS": "1",
        "LAST_STAGE_LAYERS": "3",
    },
}
CPU_RUN = {
    "MEGATRON_NPU_DEVICE": "cpu",
    "HOSTS": "127.0.0.1",
    "NNODES": "1",
    "MASTER_ADDR": "127.0.0.1",
    "NPROC_PER_NODE": "2",
    "CP": "1",
    "VPP": "0",
    "TRAIN_ITERS": "2",
    "LR_WARMUP_ITERS": "0",
    "EVAL_ITERS": "0",
    "DTYPE": "fp32",
    "DATA_PATH": "",
    "TOKENIZER_TYPE": "NullTokenizer",
    "TOKENIZER_MODEL": "",
    "CHECKPOINT_SAVE": "",
    "CHECKPOINT_LOAD": "",
    "RANK_MAP_CHECK": "0",
    "EXTRA_ARGS": "--mock-data --vocab-size 1024",
}


def _layout_for_two_ranks(name: str) -> dict[str, str]:
    text = (EXAMPLES / f"{name}.sh").read_text()
    moe = "NUM_EXPERTS" in text
    base = {"TP": "1", "PP": "1", "EP": "2"} if moe else {"TP": "2", "PP": "1", "EP": "1"}
    return base | TWO_RANKS.get(name, {})


def dry_run_command(name: str) -> list[str]:
    """The pretrain_gpt.py flags node 0 runs, from the recipe's --dry-run."""
    env = {k: v for k, v in os.environ.items() if k not in TINY}
    out = subprocess.run(
        ["bash", str(EXAMPLES / f"{name}.sh"), "--dry-run", "--node-rank", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env | {"RANK_MAP_CHECK": "1"},  # as a user runs it: the launcher checks the rank map first
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if "pretrain_gpt.py" in x)
    argv = shlex.split(line)
    return argv[argv.index(next(a for a in argv if a.endswith("pretrain_gpt.py"))) + 1 :]


# the flags of the dry-run command that change no byte of the plan (data, checkpoints, logs, the schedule)
NOT_PLANNED = set(
    "--train-iters --lr --min-lr --lr-decay-style --lr-warmup-iters --distributed-backend --data-path --split "
    "--tokenizer-type --tokenizer-model --exit-signal-handler --save --save-interval --ckpt-format --load "
    "--log-interval --eval-interval --eval-iters --timing-log-level --log-dir --tensorboard-dir".split()
)
ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def recipe_defaults(name: str) -> dict[str, str]:
    """The recipe's environment defaults: its ``export NAME="${NAME-default}"`` lines."""
    text = (EXAMPLES / f"{name}.sh").read_text()
    return dict(re.findall(r'^export (\w+)="\$\{\1-(.*)\}"', text, flags=re.M))


def _bash_arithmetic(expr: str, env: dict[str, str]) -> str:
    """``$(( ... ))`` of names and integers with + - * / (what the recipes' flags use)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
            return ARITHMETIC[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Name):
            return int(env[node.id])
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"not a recipe's arithmetic: {expr}")

    return str(value(ast.parse(expr.replace("/", "//"), mode="eval").body))


def _expand(token: str, env: dict[str, str]) -> str:
    token = re.sub(r"\$\(\((.*?)\)\)", lambda m: _bash_arithmetic(m.group(1), env), token)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], token)


def recipe_flags(name: str) -> list[str]:
    """pretrain_gpt.py's flags the recipe's defaults give, read from its text without running it: the
    launcher's model and layout flags (scripts/pretrain_gpt_8x2.sh, examples/lib/launch.sh at their defaults)
    and the recipe's ARGS. test_dry_run_prints_a_command_the_trainer_accepts checks they are the dry run's."""
    env = recipe_defaults(name)
    seq = env["SEQ_LENGTH"]
    flags = ["--tensor-model-parallel-size", env["TP"], "--pipeline-model-parallel-size", env["PP"]]
    flags += ["--num-layers", env["NUM_LAYERS"], "--hidden-size", env["HIDDEN_SIZE"]]
    flags += ["--num-attention-heads", env["NUM_ATTENTION_HEADS"], "--seq-length", seq]
    flags += ["--max-position-embeddings", env.get("MAX_POSITION_EMBEDDINGS", seq)]
    flags += ["--micro-batch-size", env["MICRO_BATCH_SIZE"], "--global-batch-size", env["GLOBAL_BATCH_SIZE"]]
    flags += ["--sequence-parallel"] if env.get("SEQUENCE_PARALLEL", "1") == "1" else []
    flags += ["--bf16"]
    flags += ["--use-distributed-optimizer"] if env.get("DISTRIBUTED_OPTIMIZER", "1") == "1" else []
    flags += ["--context-parallel-size", env["CP"]] if env["CP"] != "1" else []
    block = re.search(r"^ARGS=\((.*?)^\)", (EXAMPLES / f"{name}.sh").read_text(), flags=re.M | re.S).group(1)
    flags += [_expand(tok, env) for tok in shlex.split(block)]
    flags += ["--num-virtual-stages-per-pipeline-rank", env["VPP"]] if env.get("VPP", "0") != "0" else []
    flags += ["--expert-model-parallel-size", env["EP"]] if env.get("EP", "1") != "1" else []
    if env.get("FIRST_STAGE_LAYERS"):
        flags += ["--decoder-first-pipeline-num-layers", env["FIRST_STAGE_LAYERS"]]
        flags += ["--decoder-last-pipeline-num-layers", env["LAST_STAGE_LAYERS"]]
    if env["RECOMPUTE"] == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return flags


def _flag_groups(argv: list[str]) -> list[tuple[str, ...]]:
    """Each flag with its values, in a canonical order (a command's flags compared as a set)."""
    groups: list[list[str]] = []
    for tok in argv:
        if tok.startswith("--"):
            groups.append([tok])
        else:
            groups[-1].append(tok)
    return sorted(tuple(g) for g in groups if g[0] not in NOT_PLANNED)


def test_there_is_a_recipe_per_family():
    assert set(RECIPES) >= {
        "llama31_8b",
        "llama31_70b_4nodes",
        "llama31_70b_16nodes",
        "qwen3_8b",
        "qwen3_30b_a3b",
        "mixtral_8x7b",
        "deepseek_v3",
        "gpt_oss_20b",
    }
    for name in RECIPES:
        text = (EXAMPLES / f"{name}.sh").read_text()
        assert "--use-flash-attn" in text and "megatron-npu preprocess" in text and "megatron-npu convert" in text
        # the layout plan --search chose and its predicted memory per card
        assert re.search(r"plan --search[^\n]*\n(#[^\n]*\n){0,3}#[^\n]*GB per card", text), name


@pytest.mark.launch
@pytest.mark.parametrize("name", RECIPES)
def test_dry_run_prints_a_command_the_trainer_accepts(name):
    from megatron_npu.plan.flags import parse_trainer_args
    from megatron_npu.policy import ConfigError

    argv = dry_run_command(name)
    text = (EXAMPLES / f"{name}.sh").read_text()
    world = int(re.search(r"NNODES-(\d+)", text).group(1)) * 8
    assert "--use-flash-attn" in argv and "--distributed-backend" in argv
    # the data and checkpoint paths of the cluster are not here: the flags and the layout are checked
    try:
        parse_trainer_args([*argv, "--vocab-size", "1024"], world)
    except ConfigError as exc:
        pytest.fail(f"{name}: {exc}")
    # the flags the header test reads from the script's text are the ones it runs
    assert _flag_groups(argv) == _flag_groups(recipe_flags(name))


def header_memory_gb(text: str) -> list[float]:
    """The header's predicted memory per card: one figure, or first stage / middle stages at most / last."""
    line = re.search(r"predicted memory: ([^\n]*?) GB per card", text).group(1)
    return [float(x) for x in re.findall(r"\d+\.\d+", line)]


@functools.cache
def recipe_plan(name: str) -> tuple[argparse.Namespace, Any, Any, Any]:
    """(settings, rank map, model, parallel spec) ``plan`` builds for the recipe's defaults (shared by the header
    tests)."""
    from megatron_npu.plan.flags import parse_trainer_args, rank_map_for, specs_from_args

    text = (EXAMPLES / f"{name}.sh").read_text()
    env = recipe_defaults(name)
    # the vocabulary the header's plan command gives (the tokenizer's; not a flag of the recipe)
    vocab = re.search(r"megatron-npu plan --search[^\n]*--vocab-size (\d+)", text).group(1)
    launcher = argparse.Namespace(nnodes=int(env["NNODES"]), nproc_per_node=int(env["NPROC_PER_NODE"]), hosts=None)
    args = parse_trainer_args([*recipe_flags(name), "--vocab-size", vocab], launcher.nnodes * launcher.nproc_per_node)
    model, par = specs_from_args(args)
    return args, rank_map_for(args, launcher), model, par


def planned_memory_gb(name: str) -> tuple[list[float], float]:
    """``plan``'s predicted memory per pipeline stage (GB) for the recipe's defaults, and the limit a card allows."""
    from megatron_npu.accelerator.facts import PLANNING_FACTS
    from megatron_npu.plan.cli import GB, memory_by_stage
    from megatron_npu.plan.search import HEADROOM

    args, rmap, model, _ = recipe_plan(name)
    stages = [m.total_bytes / GB for m in memory_by_stage(model, rmap, args)]
    return stages, PLANNING_FACTS.device_memory_gb * (1 - HEADROOM)


def header_figures(stages: list[float]) -> list[float]:
    """What a header states of the stages: one stage its figure; else the first, the largest middle one, the last."""
    if len(stages) == 1:
        return stages
    return [stages[0], *([max(stages[1:-1])] if len(stages) > 2 else []), stages[-1]]


@pytest.mark.parametrize("name", RECIPES)
def test_header_memory_is_what_plan_predicts_and_fits(name):
    stages, limit = planned_memory_gb(name)
    header = header_memory_gb((EXAMPLES / f"{name}.sh").read_text())
    expected = [round(x, 1) for x in header_figures(stages)]
    assert header == expected, f"{name}: plan predicts {[f'{x:.2f}' for x in stages]} GB per stage"
    assert max(stages) <= limit, f"{name}: {max(stages):.1f} GB per card > {limit:.1f} GB"


@pytest.mark.parametrize("name", RECIPES)
def test_header_throughput_is_the_step_time_models(name):
    """The header's tokens/s per NPU and MFU are megatron_npu/layout/step_time.py's for the recipe's layout, as
    ``plan`` prints them (its communication plan at the default link speeds)."""
    from megatron_npu.layout.planner import plan
    from megatron_npu.plan.cli import step_prediction

    args, rmap, model, par = recipe_plan(name)
    predicted = step_prediction(model, rmap, args, plan(model, rmap, par))
    text = (EXAMPLES / f"{name}.sh").read_text()
    tokens, mfu = re.search(r"predicted throughput: ([\d,]+) tokens/s per NPU, MFU ([\d.]+%)", text).groups()
    assert (tokens, mfu) == (f"{predicted.tokens_per_s_per_npu:,.0f}", f"{predicted.mfu:.1%}"), name


@pytest.mark.launch
def test_each_recipe_trains_two_iterations_scaled_down(tmp_path):
    """One torchrun job of 2 ranks per recipe, all started at once; every one must reach iteration 2."""
    jobs = {}
    for i, name in enumerate(RECIPES):
        env = os.environ | CPU_RUN | TINY | _layout_for_two_ranks(name)
        env |= {"LOG_DIR": str(tmp_path / name), "MASTER_PORT": str(29700 + i)}
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115  (closed below)
        cmd = ["bash", str(EXAMPLES / f"{name}.sh"), "--node-rank", "0"]
        jobs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
    failed = {}
    for name, (job, log) in jobs.items():
        try:
            rc = job.wait(timeout=900)  # a hang guard, not a time limit
        except subprocess.TimeoutExpired:
            job.kill()
            rc = "hung"
        log.close()
        out = (tmp_path / f"{name}.log").read_text()
        # a recipe with MTP (DeepSeek-V3: on the last of 2 uneven stages) logs its loss as Megatron-LM does
        mtp = "--mtp-num-layers" not in (EXAMPLES / f"{name}.sh").read_text() or "mtp_1 loss:" in out
        if rc != 0 or not re.search(r"iteration +2/ +2 \|", out) or not mtp:
            failed[name] = (rc, out[-1500:])
    assert not failed, failed
