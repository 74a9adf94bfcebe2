"""Per-rank parameter + gradient + optimizer-state bytes under DDP, the distributed optimizer,
Megatron-FSDP's four sharding strategies and torch FSDP2, at DP 1, 2 and 4 (cpu target, fp32).

One torchrun job per DP size (this file as the worker); in each, every scheme wraps the same
megatron-core GPT, runs one training step (so the optimizer state exists) and counts the bytes
of the live tensors it holds, each storage once.

What is counted is the state *at rest*, the figure FSDP's 1/DP promise is about: the buffers the
wrapper owns for the whole run (DDP's param and grad buffers; Megatron-FSDP's ``model_weight_buffer``,
``main_weight_buffer`` and ``main_grad_buffer``, sharded or whole by strategy; FSDP2's DTensor shards)
and the optimizer's state. Megatron-FSDP's unsharded weights live in its *temporary* buckets
(``weight_alloc`` / ``transpose_weight_alloc`` / ``main_grad_alloc``): a working set gathered for
one unit's forward or backward and released after it, like the all-gather buckets of the
distributed optimizer. Right after the step its post-step all-gather has already refilled them
with the next forward's weights (with ``optim_grads_params``, the whole model at that moment: the
0.45 of DP1 measured before counted them as state); they are shown in a column of their own,
"gathered", and left out of the ratios. Counting after the next forward instead would leave the
non-unit modules (embedding, output layer) gathered, which Megatron-FSDP keeps whole through an
iteration, so it would measure the schedule's working set, not the sharded state.

    python benchmarks/fsdp_memory.py [--layers 4 --hidden 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMES = ("torch_fsdp2", "ddp", "dist_opt", "no_shard", "optim", "optim_grads", "optim_grads_params")
DP_SIZES = (1, 2, 4)


# ----- worker (one rank) ---------------------------------------------------------------------
def _local(tensor):  # a DTensor's shard, a plain tensor as is
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class Ledger:
    """Bytes per category; a storage counts once, in the first category that names it."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes = {"gathered": 0, "params": 0, "grads": 0, "optimizer": 0}

    def add(self, category: str, tensor) -> None:
        import torch

        if not isinstance(tensor, torch.Tensor):
            return
        storage = _local(tensor).untyped_storage()
        if storage.data_ptr() in self.seen or storage.nbytes() == 0:
            return
        self.seen.add(storage.data_ptr())
        self.bytes[category] += storage.nbytes()


def _buffers(model) -> tuple[list, list]:
    """(parameter buffers, gradient buffers) of a megatron-core DDP or Megatron-FSDP wrapper."""
    params, grads = [], []
    ddp_buffers = model.__dict__.get("buffers", [])  # DDP's _ParamAndGradBuffers (else Module.buffers)
    for buffer in ddp_buffers:
        params.append(buffer.param_data)
        grads.append(buffer.grad_data)
    fsdp = getattr(getattr(model, "module", None), "param_and_grad_buffer", None)
    for group in getattr(fsdp, "parameter_groups", []):
        for name in ("model_weight_buffer", "main_weight_buffer"):
            params.append(getattr(getattr(group, name, None), "data", None))
        grads.append(getattr(group.main_grad_buffer, "data", None))
    return params, grads


def _temporary_buckets(model) -> list:
    """Megatron-FSDP's temporary (unsharded) buckets that hold storage now: the gathered working set."""
    fsdp = getattr(getattr(model, "module", None), "param_and_grad_buffer", None)
    allocators = [getattr(fsdp, name, None) for name in ("weight_alloc", "transpose_weight_alloc", "main_grad_alloc")]
    return [bucket.data for alloc in allocators for bucket in getattr(alloc, "buckets", {}).values()]


def measure(model, optimizer) -> dict[str, int]:
    ledger = Ledger()
    for tensor in _temporary_buckets(model):  # first, so parameters viewing them are not counted as state
        ledger.add("gathered", tensor)
    buffer_params, buffer_grads = _buffers(model)
    for tensor in buffer_params + [p for p in model.parameters()]:
        ledger.add("params", tensor)
    inner = getattr(optimizer, "optimizer", optimizer)
    for group in inner.param_groups:  # fp32 main params of the distributed optimizer
        for param in group["params"]:
            ledger.add("params", param)
    for tensor in buffer_grads + [getattr(p, "main_grad", None) for p in model.parameters()]:
        ledger.add("grads", tensor)
    for param in model.parameters():
        ledger.add("grads", param.grad)
    for state in inner.state.values():
        for value in state.values():
            if getattr(value, "numel", lambda: 0)() > 1:  # the step counters are scalars
                ledger.add("optimizer", value)
    return ledger.bytes


def _model(layers: int, hidden: int):
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        transformer_impl="local",  # as this project's spec: FSDP2 wraps layers and embeddings, not each linear
    )
    spec = get_gpt_layer_local_spec()
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=1024,
        max_sequence_length=64,
        share_embeddings_and_output_weights=False,
    )
    return config, model


def _wrap(scheme: str, config, model):
    import torch
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        TorchFullyShardedDataParallel,
        TorchFullyShardedDataParallelConfig,
    )
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    if scheme in ("ddp", "dist_opt"):
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=scheme == "dist_opt")
        return DistributedDataParallel(config, ddp, model), ddp
    if scheme == "torch_fsdp2":  # as megatron_npu/training/fsdp.py builds it
        fsdp2 = TorchFullyShardedDataParallelConfig()
        return TorchFullyShardedDataParallel(config, fsdp2, model), fsdp2
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=scheme,
    )
    return FullyShardedDataParallel(config, ddp, model, device=torch.device("cpu")), ddp


def _one_step(model, optimizer) -> None:
    import torch

    tokens = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(64).unsqueeze(0).expand(2, -1)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    model(tokens, positions, None, labels=tokens).float().mean().backward()
    model.finish_grad_sync()
    optimizer.step()


def worker(layers: int, hidden: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    import megatron_npu  # noqa: F401  (the patch layer: gloo, the cpu device)

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    figures = {}
    for scheme in SCHEMES:
        config, model = _model(layers, hidden)
        try:
            wrapped, ddp = _wrap(scheme, config, model)
            optimizer_config = OptimizerConfig(
                optimizer="adam", lr=1e-4, use_distributed_optimizer=ddp.use_distributed_optimizer
            )
            optimizer = get_megatron_optimizer(optimizer_config, [wrapped])
            _one_step(wrapped, optimizer)
        except Exception as error:  # a scheme megatron-core cannot step here: said in the table, not hidden
            figures[scheme] = {"error": f"{type(error).__name__}: {error}"[:200]}
            continue
        figures[scheme] = measure(wrapped, optimizer)
        del wrapped, optimizer, model
    if dist.get_rank() == 0:
        numel = sum(p.numel() for p in _model(layers, hidden)[1].parameters())
        os.write(
            1, ("RESULT " + json.dumps({"dp": dist.get_world_size(), "numel": numel, "bytes": figures}) + "\n").encode()
        )
    dist.destroy_process_group()


# ----- driver ------------------------------------------------------------------------------
def run_dp(dp: int, layers: int, hidden: int) -> dict:
    env = dict(os.environ, MEGATRON_NPU_DEVICE="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={dp}",
        __file__,
        "--worker",
        "--layers",
        str(layers),
        "--hidden",
        str(hidden),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"DP {dp} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


STATE = ("params", "grads", "optimizer")


def state_total(figures: dict[str, int]) -> int:
    """Parameter + gradient + optimizer bytes at rest (the gathered working set excluded)."""
    return sum(figures[k] for k in STATE)


def print_model_check(results: dict[int, dict]) -> None:
    """The memory model's figure (megatron_npu/layout/fsdp_comm.py state_bytes_per_rank, which
    ``megatron-npu plan`` uses) beside each measured one: the worst relative error per scheme."""
    from megatron_npu.layout.fsdp_comm import state_bytes_per_rank

    numel = results[DP_SIZES[0]]["numel"]
    errors = {}
    for scheme in SCHEMES:
        measured = {dp: results[dp]["bytes"][scheme] for dp in DP_SIZES}
        if any("error" in m for m in measured.values()):
            continue
        model = {dp: sum(state_bytes_per_rank(numel, dp, scheme).values()) for dp in DP_SIZES}
        errors[scheme] = max(abs(state_total(measured[dp]) / model[dp] - 1) for dp in DP_SIZES)
    print(
        "memory model (fsdp_comm.state_bytes_per_rank) vs measured, worst over DP sizes: "
        + ", ".join(f"{scheme} {error:.2%}" for scheme, error in errors.items())
    )


def report(results: dict[int, dict]) -> None:
    first = results[DP_SIZES[0]]
    print(
        f"model: {first['numel']:,} parameters, fp32, Adam; bytes per rank (params + grads + optimizer state, at rest)"
    )
    print(
        f"{'scheme':<20}"
        + "".join(f"{'DP' + str(dp):>14}" for dp in DP_SIZES)
        + "".join(f"{'DP' + str(dp) + '/DP1':>10}" for dp in DP_SIZES[1:])
        + f"{'gathered DP' + str(DP_SIZES[-1]):>16}"
    )
    for scheme in SCHEMES:
        failed = [results[dp]["bytes"][scheme]["error"] for dp in DP_SIZES if "error" in results[dp]["bytes"][scheme]]
        if failed:
            print(f"{scheme:<20}failed: {failed[0]}")
            continue
        totals = [state_total(results[dp]["bytes"][scheme]) for dp in DP_SIZES]
        ratios = "".join(f"{total / totals[0]:>10.3f}" for total in totals[1:])
        gathered = results[DP_SIZES[-1]]["bytes"][scheme]["gathered"]
        print(f"{scheme:<20}" + "".join(f"{total:>14,}" for total in totals) + ratios + f"{gathered:>16,}")
    for scheme in [s for s in SCHEMES if all("error" not in results[dp]["bytes"][s] for dp in DP_SIZES)]:
        parts = " | ".join(
            f"DP{dp} " + " ".join(f"{k} {v:,}" for k, v in results[dp]["bytes"][scheme].items()) for dp in DP_SIZES
        )
        print(f"  {scheme}: {parts}")
    print_model_check(results)
    target = results[4]["bytes"]["optim_grads_params"]
    if "error" not in target:
        quarter = state_total(results[1]["bytes"]["optim_grads_params"]) / 4
        print(f"optim_grads_params DP4 / (DP1 / 4) = {state_total(target) / quarter:.4f} (target: within 5% of 1)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.layers, args.hidden)
    report({dp: run_dp(dp, args.layers, args.hidden) for dp in DP_SIZES})


if __name__ == "__main__":
    main()
