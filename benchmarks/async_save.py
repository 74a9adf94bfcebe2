"""Training stall per checkpoint save: --async-save over the synchronous save.

Runs pretrain_gpt.py twice on the cpu target (the same model, saving every --save-interval
iterations), once with synchronous saves and once with --async-save, and times the iteration lines
as they arrive: the stall of a save at iteration N is the time between the line of N and the start of
the step of N+1 (its line's arrival less its elapsed time), less the median of that time between two
iterations without a save: the time the loop did not train. The model is sized so that its checkpoint
(weights and Adam state, fp32) takes seconds to write. Prints each run's stalls, the synchronous
save's, and the ratio async / sync (the goal: at most 0.1).

    python benchmarks/async_save.py [--hidden-size 1024] [--num-layers 8] [--nproc 1] [--trainer-flags "--manual-gc"]

Measured on the shared 2-core machine (load average 18-64), --hidden-size 768 --num-layers 6, 1 rank,
498 MiB a save, two runs: sync 3.00, 4.93, 6.20 s / async 0.40, 0.08, 0.09 s (ratios 0.135, 0.017, 0.014; mean
0.041), and sync 3.92, 3.31, 1.68 s / async 0.42, 0.09, 0.10 s (0.107, 0.026, 0.058; mean 0.068). Both modes start
megatron-core's writer Manager at start-up (before, the first save of either mode started it: 3.96 of the first
async save's 4.36 s); the first save's remaining stall is mostly a full garbage collection falling into it. With
--trainer-flags "--manual-gc" (Megatron-LM's manual collection: none inside a step or a save), one run at load 11-16:
sync 3.38, 1.37, 3.57 s / async 0.07, 0.07, 0.07 s (0.021, 0.053, 0.018; mean 0.025).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ITERATION = re.compile(r"\] iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([\d.]+)")


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(save: Path, options: argparse.Namespace, asynchronous: bool) -> dict[int, tuple[float, float]]:
    """One training run; returns, per iteration, when its step started and ended (its line's arrival,
    less its elapsed time): a step slowed by a writer sharing the CPU is not time training stood still."""
    shutil.rmtree(save, ignore_errors=True)
    heads = max(1, options.hidden_size // 64)
    flags = (
        f"--num-layers {options.num_layers} --hidden-size {options.hidden_size} --num-attention-heads {heads} "
        f"--seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 --global-batch-size {options.nproc} "
        f"--lr 1e-4 --train-iters {options.iterations} --save-interval {options.save_interval} "
        "--eval-iters 0 --num-workers 0 --log-interval 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024"
    ).split()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={options.nproc}",
        f"--master_port={_port()}",
        str(ROOT / "pretrain_gpt.py"),
        *flags,
        "--save",
        str(save),
        *(["--async-save"] if asynchronous else []),
        *options.trainer_flags.split(),
    ]
    env = dict(os.environ, MEGATRON_NPU_DEVICE="cpu", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    arrived: dict[int, tuple[float, float]] = {0: (time.monotonic(),) * 2}  # 0: the launch
    with subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as job:
        for line in job.stdout:
            found = ITERATION.search(line)
            if found:
                now = time.monotonic()
                arrived[int(found.group(1))] = (now - float(found.group(2)) / 1000, now)
    if job.returncode != 0:
        raise SystemExit(f"{'async' if asynchronous else 'sync'} run failed ({job.returncode})")
    return arrived


def stalls(arrived: dict[int, tuple[float, float]], save_interval: int) -> tuple[dict[int, float], float]:
    """(the stall of each save followed by an iteration, by iteration; the median time between steps without
    a save)."""
    gaps = {i: arrived[i + 1][0] - arrived[i][1] for i in arrived if i + 1 in arrived and i > 0}
    plain = statistics.median(gap for i, gap in gaps.items() if i % save_interval and i > 1)
    return {i: gaps[i] - plain for i in sorted(gaps) if i % save_interval == 0}, plain


def checkpoint_bytes(save: Path) -> int:
    """The size of one save (the last)."""
    last = max(save.glob("iter_*"))
    return sum(path.stat().st_size for path in last.rglob("*") if path.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=13)
    parser.add_argument("--save-interval", type=int, default=4)
    parser.add_argument(
        "--trainer-flags", default="", help='more pretrain_gpt.py flags for both runs, e.g. "--manual-gc"'
    )
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="async_save_") as scratch:
        save = Path(scratch) / "ckpt"
        per_save, startup = {}, {}
        for name, asynchronous in (("sync", False), ("async", True)):
            arrived = run(save, options, asynchronous)
            per_save[name], step = stalls(arrived, options.save_interval)
            startup[name] = arrived[1][0] - arrived[0][0]  # launch to the first step (--async-save starts its Manager)
            size = checkpoint_bytes(save) / 2**20
            print(f"{name:5}: {size:.0f} MiB a save; {step:.2f} s between steps without a save")
    print(f"{'save at iteration':>18} {'sync stall (s)':>15} {'async stall (s)':>16} {'async / sync':>13}")
    for iteration in per_save["sync"]:
        sync, asynchronous = per_save["sync"][iteration], per_save["async"][iteration]
        print(f"{iteration:>18} {sync:>15.2f} {asynchronous:>16.2f} {asynchronous / sync:>13.3f}")
    mean = {name: statistics.mean(values.values()) for name, values in per_save.items()}
    print(
        f"{'mean':>18} {mean['sync']:>15.2f} {mean['async']:>16.2f} {mean['async'] / mean['sync']:>13.3f}  (goal: <= 0.1)"
    )
    print(f"launch to the first step: sync {startup['sync']:.1f} s, async {startup['async']:.1f} s")


if __name__ == "__main__":
    main()
