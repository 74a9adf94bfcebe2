"""Real pretrain_gpt.py runs shared by the trainer, layout and performance tests.

Each run is one torchrun launch on the cpu target (megatron-core's import costs
5-10 s per process), so runs are session-scoped and several tests read each.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from distributed import ROOT, Job, torchrun

PRETRAIN = ROOT / "pretrain_gpt.py"

# A small GPT: 4 layers so TP2 x PP2 x VPP2 has one layer per virtual stage;
# 8 samples per step so TP2 x PP2 (DP1) runs 4 micro-batches (the pipeline's steady state).
# the model and batch shape (the planner takes these too: tests/test_perf_report.py)
SHAPE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8"
).split()
MODEL = [
    *SHAPE,
    *(
        "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 "
        "--seed 1234 --log-interval 1 --eval-interval 2 --eval-iters 1 --num-workers 0"
    ).split(),
]
MOCK_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


def pretrain(run_dir: Path, *flags: str, nproc: int = 1, timeout: float = 600, mock_data: bool = True) -> Job:
    """Launch pretrain_gpt.py with MODEL (+ MOCK_DATA) + flags, logs under run_dir/logs."""
    data = MOCK_DATA if mock_data else []
    return torchrun(PRETRAIN, *MODEL, *data, *flags, "--log-dir", str(run_dir / "logs"), nproc=nproc, timeout=timeout)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {m["iteration"]: m["lm_loss"] for m in metrics(run_dir) if "lm_loss" in m}


def validation_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(m["iteration"], m["validation"]["lm loss"]) for m in metrics(run_dir) if "validation" in m]


def checkpoint_at(source: Path, iteration: int, destination: Path) -> Path:
    """A checkpoint root holding only ``iteration`` of ``source`` (as a user picks an older one)."""
    destination.mkdir(parents=True, exist_ok=True)
    name = f"iter_{iteration:07d}"
    shutil.copytree(source / name, destination / name)
    (destination / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return destination
