"""Activation memory per rank under context parallelism: saved-for-backward bytes at CP1, CP2, CP4.

Builds megatron-core's GPTModel with its local layer spec and the CP attention of
megatron_npu/ops/context_parallel.py (at CP1 too: a ring of one rank) on the cpu target, feeds one
sequence split by megatron-core's get_batch_on_this_cp_rank, and counts, under
torch.autograd.graph.saved_tensors_hooks, the bytes autograd keeps for the backward during the
forward (each storage once). One torchrun launch per CP size (``--cp 1 2 4``); prints the bytes of
rank 0 and the ratio to CP1 per comm type.

    python benchmarks/cp_memory.py [--seq-length 4096] [--cp 1 2 4] [--comm-type p2p a2a]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"layers": 2, "hidden": 256, "heads": 8, "vocab": 1024, "batch": 1}


def measure(seq_length: int, comm_type: str) -> dict:
    """In a torchrun rank: saved-for-backward bytes of one forward of this rank's share."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.utils import get_batch_on_this_cp_rank

    import megatron_npu  # noqa: F401  (patch layer)
    from megatron_npu.ops.spec_provider import DeviceSpecProvider

    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=cp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=SHAPE["layers"],
        hidden_size=SHAPE["hidden"],
        num_attention_heads=SHAPE["heads"],
        attention_dropout=0.0,
        hidden_dropout=0.0,
        context_parallel_size=cp,
        cp_comm_type=comm_type,
    )
    spec = get_gpt_layer_local_spec()
    # CP1 too: the same attention (a ring of one), so the ratio is the split's, not another kernel's
    attention = DeviceSpecProvider(context_parallel=True).core_attention()
    spec.submodules.self_attention.submodules.core_attention = attention
    model = GPTModel(config, spec, SHAPE["vocab"], seq_length, position_embedding_type="rope")
    tokens = torch.randint(0, SHAPE["vocab"], (SHAPE["batch"], seq_length), generator=torch.Generator().manual_seed(0))
    batch = get_batch_on_this_cp_rank(
        {"tokens": tokens, "labels": tokens.roll(-1, 1), "position_ids": torch.arange(seq_length).unsqueeze(0)}
    )
    storages: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).sum()
    loss.backward()  # the saved tensors were right: the backward runs
    weight_bytes = sum(n for ptr, n in storages.items() if ptr in weights)  # the weights a backward reads
    return {"cp": cp, "rank": dist.get_rank(), "saved_bytes": sum(storages.values()), "weight_bytes": weight_bytes}


def predicted(cp: int, seq_length: int) -> int:
    """megatron_npu/layout/memory.py's saved bytes of one micro-batch for this model and CP size."""
    from megatron_npu.layout.memory import MemorySettings, predict
    from megatron_npu.layout.parallel_dims import ParallelDims
    from megatron_npu.layout.planner import ModelSpec

    model = ModelSpec(
        SHAPE["layers"],
        SHAPE["hidden"],
        SHAPE["heads"],
        seq_length,
        SHAPE["batch"],
        SHAPE["batch"],
        SHAPE["vocab"],
        position_embedding_type="rope",
        params_dtype="fp32",
        make_vocab_size_divisible_by=1,
    )
    settings = MemorySettings(attention_dropout=0.0, hidden_dropout=0.0)
    return predict(model, ParallelDims(world_size=cp, cp=cp), settings, 0).saved_per_microbatch[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(cp: int, seq_length: int, comm_type: str) -> dict:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={cp}",
        f"--master_port={free_port()}",
        __file__,
        "--worker",
        "--seq-length",
        str(seq_length),
        "--comm-type",
        comm_type,
    ]
    env = dict(os.environ, MEGATRON_NPU_DEVICE="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    results = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not results:
        raise SystemExit(f"CP{cp} {comm_type} failed:\n{done.stderr[-3000:]}")
    return max(results, key=lambda r: r["saved_bytes"])  # the rank that keeps the most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--comm-type", nargs="+", default=["p2p", "a2a"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        # one write per line: the ranks share the pipe, and print may split a line between two writes
        os.write(1, ("RESULT " + json.dumps(measure(args.seq_length, args.comm_type[0])) + "\n").encode())
        return
    print(f"seq {args.seq_length}, {SHAPE}: saved-for-backward bytes per rank (the largest rank)")
    for comm_type in args.comm_type:
        base = None
        for cp in args.cp:
            found = launch(cp, args.seq_length, comm_type)
            base = base or found["saved_bytes"]
            ratio = found["saved_bytes"] / base
            activations = found["saved_bytes"] - found["weight_bytes"]
            line = f"{comm_type:8s} CP{cp}: {found['saved_bytes'] / 2**20:9.1f} MiB  ({ratio:.3f} of CP1, 1/CP = {1 / cp:.3f})"
            line += f"; without the weights {activations / 2**20:.1f} MiB"
            if cp > 1:  # the model's CP1 is megatron-core's attention, not the ring of one run here
                model = predicted(cp, args.seq_length)
                line += f", the memory model {model / 2**20:.1f} MiB ({model / activations - 1:+.1%})"
            print(line)


if __name__ == "__main__":
    main()
