"""Megatron-LM core_v0.16.1's own pretrain_gpt.py resumes an MoE run saved under EP2 under TP2 x EP2 with
sequence parallelism, with the uninterrupted run's losses (fp32, rel 1e-5), given the flag its checkpoint
format needs: ``--dist-ckpt-optim-fully-reshardable`` when saving.

Megatron-LM 0.16.1 saves the distributed optimizer ``dp_reshardable`` unless told otherwise: that state
loads only under the layout that saved it, and its loader's guard compares TP and PP but not EP (see
docs/megatron-lm.md, "Changing the layout on resume"). Its RNG states are ignored here, as Megatron-LM does
whenever TP or PP change. Both runs start from one checkpoint: each EP rank draws its experts from its own
RNG stream, so runs from scratch under two layouts start from different weights by design.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from distributed import Job
from megatron_lm_checkout import NEEDS_EXTRACT, upstream
from pretrain_runs import MOCK_DATA, NO_DROPOUT

pytestmark = [
    pytest.mark.launch,
    NEEDS_EXTRACT,
]

# A tiny MoE GPT: 2 layers of 4 experts (top 2), dropless all-to-all dispatch, no biases (megatron-core
# allows MoE biases only with expert TP 1; ETP follows TP here), fp32, no dropout, no evaluation.
MODEL = [
    *("--transformer-impl", "local", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128"),
    *("--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32"),
    *("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"),
    *("--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"),
    *("--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "5"),
    *("--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2"),
    *("--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234", "--log-interval", "1"),
    *("--eval-interval", "1000", "--eval-iters", "0", "--num-workers", "0"),
    *NO_DROPOUT,
    *MOCK_DATA,
    "--use-distributed-optimizer",
]
SAVE_AT = 2
RESUMED = (3, 4, 5)
EP2 = ("--expert-model-parallel-size", "2")
TP2_EP2_SP = ("--tensor-model-parallel-size", "2", *EP2, "--sequence-parallel")
LOSS_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)")


def iteration_losses(job: Job) -> dict[int, float]:
    """Each iteration's own lm loss. Megatron-LM's training_log does not reset its accumulator after a
    process's first line (training.py: ``should_reset = not is_first_iteration``), so with
    --log-interval 1 a process's second line is the mean of its first two iterations: undone here."""
    lines = [(int(m.group(1)), float(m.group(2))) for m in map(LOSS_LINE.search, job.stdout.splitlines()) if m]
    assert len(lines) >= 2, f"no iteration lines\n{job.stdout[-3000:]}\n{job.stderr[-3000:]}"
    (first, first_loss), (second, second_mean) = lines[:2]
    return {first: first_loss, second: 2 * second_mean - first_loss, **dict(lines[2:])}


@pytest.fixture(scope="module")
def ep2(megatron_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], Path]:
    """The uninterrupted run under EP2 x DP2 (2 ranks), saving fully reshardable at SAVE_AT."""
    save = tmp_path_factory.mktemp("ep2") / "ckpt"
    flags = ("--save", str(save), "--save-interval", str(SAVE_AT), "--dist-ckpt-optim-fully-reshardable")
    job = upstream(megatron_lm, *MODEL, *EP2, *flags, nproc=2).check()
    return iteration_losses(job), save


def test_ep2_checkpoint_resumes_under_tp2_x_ep2_with_sequence_parallel_exactly(megatron_lm, ep2, tmp_path):
    reference, save = ep2
    assert sorted(reference) == [1, 2, 3, 4, 5]
    assert reference[5] < reference[1]
    load = tmp_path / "ckpt"  # only the iteration-SAVE_AT checkpoint, as a user picks it
    shutil.copytree(save / f"iter_{SAVE_AT:07d}", load / f"iter_{SAVE_AT:07d}")
    (load / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    job = upstream(megatron_lm, *MODEL, *TP2_EP2_SP, "--load", str(load), nproc=4).check()
    # the layout changed (Megatron-LM's own words) and the optimizer state was read, not started fresh
    assert "(TP, PP) mismatch after resume ((2, 1) vs (1, 1) from checkpoint): RNG state will be ignored" in job.stdout
    assert "'distrib_optim_sharding_type': 'fully_reshardable'" in job.stdout
    resumed = iteration_losses(job)
    assert sorted(resumed) == list(RESUMED)
    # iteration 3 reads the resharded weights; 4 and 5 also the resharded Adam moments and step
    for iteration in RESUMED:
        assert resumed[iteration] == pytest.approx(reference[iteration], rel=1e-5, abs=0), iteration
