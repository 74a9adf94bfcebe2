"""``megatron-npu demo``: the doctor, then a small GPT trained with TP2 x PP2.

It launches torchrun with 4 ranks on the selected accelerator (the cpu target,
gloo, when no NPU is present) running megatron_npu/examples/gpu_style_gpt.py: a
megatron-core training script written for GPUs whose only change is
``import megatron_npu``. It prints the loss per step.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from . import doctor

EXAMPLE = Path(__file__).parent / "examples" / "gpu_style_gpt.py"
RESULT_PREFIX = "RESULT "  # the example prints one such JSON line per rank


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-npu demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args(argv)
    if args.nproc % (args.tp * args.pp):
        parser.error(f"--nproc {args.nproc} is not a multiple of --tp x --pp = {args.tp * args.pp}")
    print("\n".join(doctor.render(doctor.collect()).splitlines()[:5]))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
        str(EXAMPLE), "--tp", str(args.tp), "--pp", str(args.pp), "--steps", str(args.steps), "--tied",
        "--repeat-data", "2",
    ]  # fmt: skip
    print("+ " + " ".join(command), flush=True)
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    losses = [
        json.loads(line[len(RESULT_PREFIX) :])["losses"]
        for line in completed.stdout.splitlines()
        if line.startswith(RESULT_PREFIX)
    ]
    losses = next((item for item in losses if item), None)
    if completed.returncode != 0 or not losses:
        sys.stderr.write(completed.stderr[-4000:])
        print(f"demo failed (exit {completed.returncode})", file=sys.stderr)
        return completed.returncode or 1
    for step, loss in enumerate(losses):
        print(f" iteration {step + 1:8d}/{len(losses):8d} | lm loss: {loss:.6E} |")
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps (TP{args.tp} x PP{args.pp})")
    return 0
