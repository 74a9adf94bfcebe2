"""examples/: one launch recipe per model family, checked as a user runs them.

* ``--dry-run`` (no process): each recipe prints every node's environment and pretrain_gpt.py command at
  its full size and layout, and the trainer's own parser and validation accept that command for the
  recipe's world size (what ``megatron-npu plan`` reads too).
* scaled down (one torchrun job per recipe, on the cpu target): the same script and flags with tiny
  sizes and a 2-rank layout through its documented environment variables, 2 iterations.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

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
        env=env | {"RANK_MAP_CHECK": "0"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if "pretrain_gpt.py" in x)
    argv = shlex.split(line)
    return argv[argv.index(next(a for a in argv if a.endswith("pretrain_gpt.py"))) + 1 :]


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
