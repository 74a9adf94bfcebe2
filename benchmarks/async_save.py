"""Training stall per checkpoint save: --async-save over the synchronous save.

Runs pretrain_gpt.py twice on the cpu target (the same model, saving every --save-interval
iterations), once with synchronous saves and once with --async-save, and times the iteration lines
as they arrive: the stall of a save at iteration N is the time between the line of N and the start of
the step of N+1 (its line's arrival less its elapsed time), less the median of that time between two
iterations without a save: the time the loop did not train. The model is sized so that its checkpoint
(weights and Adam state, fp32) takes seconds to write. Prints each run's stalls, the synchronous
save's, and the ratio async / sync (the goal: at most 0.1).

    python benchmarks/async_save.py [--hidden-size 1024] [--num-layers 8] [--nproc 1]

Measured on the shared 2-core machine (load average 15-38), --hidden-size 768 --num-layers 6, 1 rank,
~500 MiB a save: sync 29.02, 11.40, 8.58 s; async 8.44, 0.29, 0.20 s; ratio 0.182, 0.024 from the second
save on (the first also starts megatron-core's spawned writer Manager and plans the layout, in both modes).
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
    ]
    env = dict(os.environ, MEGATRON_NPU_DEVICE="cpu", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    arrived: dict[int, tuple[float, float]] = {}
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


def stalls(arrived: dict[int, tuple[float, float]], save_interval: int) -> tuple[list[float], float]:
    """(the stall of each save followed by an iteration, the median time between steps without a save)."""
    gaps = {i: arrived[i + 1][0] - arrived[i][1] for i in arrived if i + 1 in arrived}
    plain = statistics.median(gap for i, gap in gaps.items() if i % save_interval and i > 1)
    return [gaps[i] - plain for i in sorted(gaps) if i % save_interval == 0], plain


def checkpoint_bytes(save: Path) -> int:
    return sum(path.stat().st_size for path in save.rglob("*") if path.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=13)
    parser.add_argument("--save-interval", type=int, default=4)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="async_save_") as scratch:
        save = Path(scratch) / "ckpt"
        results = {}
        for name, asynchronous in (("sync", False), ("async", True)):
            per_save, step = stalls(run(save, options, asynchronous), options.save_interval)
            results[name] = statistics.mean(per_save)
            # the first save also starts megatron-core's writer Manager (a spawned process) and plans the layout
            results[f"{name} later"] = statistics.mean(per_save[1:])
            size = checkpoint_bytes(save) / 2**20
            shown = ", ".join(f"{s:.2f}" for s in per_save)
            print(
                f"{name:5}: stall per save {results[name]:.2f} s ({shown}); between steps {step:.2f} s; {size:.0f} MiB"
            )
    print(f"async / sync stall: {results['async'] / results['sync']:.3f} (goal: <= 0.1)")
    print(f"async / sync stall from the second save on: {results['async later'] / results['sync later']:.3f}")


if __name__ == "__main__":
    main()
