"""``megatron-npu demo``: the doctor, then pretrain_gpt.py on the bundled corpus with TP2 x PP2.

It preprocesses the bundled corpus (data/demo_corpus.jsonl, with the bundled
SentencePiece model) into Megatron's indexed format, then launches torchrun with 4
ranks running this project's pretrain_gpt.py with Megatron-LM flags: a small GPT,
tensor parallel 2 x pipeline parallel 2, about 100 iterations, an evaluation and a
checkpoint. The accelerator decides the devices: NPUs where torch_npu imports, else
GPUs, else the CPU over gloo. Everything lands in --output-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from megatron_npu import doctor

PRETRAIN = Path(__file__).resolve().parents[1] / "pretrain_gpt.py"

# A GPT small enough for 2 CPU cores: 6144-token vocabulary, 4 layers of width 128.
MODEL_FLAGS = [
    "--num-layers",
    "4",
    "--hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "128",
    "--max-position-embeddings",
    "128",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "16",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-decay-style",
    "cosine",
    "--weight-decay",
    "0.1",
    "--clip-grad",
    "1.0",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--tokenizer-type",
    "GPTSentencePieceTokenizer",
    "--split",
    "98,2,0",
    "--log-interval",
    "10",
    "--eval-interval",
    "50",
    "--eval-iters",
    "2",
    "--num-workers",
    "0",
    "--use-distributed-optimizer",
    "--log-throughput",
    "--timing-log-level",
    "1",
]


WARMUP_ITERS = 10


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_command(args: argparse.Namespace, data_prefix: str, tokenizer_model: str, output: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={args.nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(PRETRAIN),
        *MODEL_FLAGS,
        "--train-iters",
        str(args.iters),
        "--lr-warmup-iters",  # megatron-core's scheduler needs warmup < decay (decay = the run's iterations)
        str(min(WARMUP_ITERS, args.iters // 2)),
        "--tensor-model-parallel-size",
        str(args.tp),
        "--pipeline-model-parallel-size",
        str(args.pp),
        "--data-path",
        data_prefix,
        "--tokenizer-model",
        tokenizer_model,
        "--save",
        str(output / "checkpoints"),
        "--save-interval",
        str(args.iters),
        "--log-dir",
        str(output / "logs"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-npu demo", description=__doc__)
    parser.add_argument("--iters", type=int, default=100, help="training iterations (default: %(default)s)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default: %(default)s)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default: %(default)s)")
    parser.add_argument(
        "--nproc", type=int, default=4, help="ranks on this machine, a multiple of TP x PP (default: %(default)s)"
    )
    parser.add_argument("--output-dir", default="megatron-npu-demo", help="data, checkpoints and logs go here")
    args = parser.parse_args(argv)
    for flag in ("iters", "tp", "pp", "nproc"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1")
    if args.nproc % (args.tp * args.pp):
        parser.error(f"--nproc {args.nproc} is not a multiple of --tp x --pp = {args.tp * args.pp}")
    if not PRETRAIN.exists():
        parser.error(f"{PRETRAIN} is missing: the demo runs from a source checkout (pip install -e .)")
    from megatron_npu.data import DEMO_TOKENIZER_MODEL, ensure_demo_dataset

    output = Path(args.output_dir).resolve()
    print("\n".join(doctor.render(doctor.collect()).splitlines()[:5]), flush=True)
    data_prefix = ensure_demo_dataset(str(output / "data"))
    metrics_file = output / "logs" / "metrics.jsonl"
    metrics_file.unlink(missing_ok=True)  # this run's figures only
    command = build_command(args, data_prefix, DEMO_TOKENIZER_MODEL, output)
    print("+ " + " ".join(command), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    started = time.monotonic()
    status = subprocess.run(command, env=env).returncode
    if status != 0:
        print(f"megatron-npu demo: error: the training run failed (exit {status}); its cause is above", file=sys.stderr)
        return status
    losses = [json.loads(line)["lm_loss"] for line in metrics_file.read_text().splitlines() if '"lm_loss"' in line]
    print(
        f"\nloss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} iterations "
        f"(TP{args.tp} x PP{args.pp}, {time.monotonic() - started:.0f} s); "
        f"checkpoint in {output / 'checkpoints'}, logs in {output / 'logs'}"
    )
    return 0
