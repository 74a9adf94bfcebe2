"""tests/fixtures/gpu_style_gpt.py's GPU-written training (its functions), with a megatron-core dist-checkpoint resume.

One launch: train ``--steps`` steps saving model and optimizer (megatron-core's ``sharded_state_dict`` +
``dist_checkpointing.save``, as a GPU user's script does) after ``--save-at``; then build the model and
optimizer again from another seed, load that checkpoint and train the remaining steps. Every rank prints one
RESULT line: the uninterrupted losses, the resumed ones, and whether every parameter ended equal.

Usage: torchrun --nproc_per_node N gpu_style_resume.py --tp T --pp P [--dist-opt] --init-from w.pt
       --steps S --save-at K --ckpt DIR
"""

import argparse
import inspect
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.optimizer import distrib_optimizer

import megatron_npu  # noqa: F401  (the only change to a GPU script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from gpu_style_gpt import gpt_model, load_full_weights, model_config, train, wrap  # noqa: E402


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dist-opt", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--init-from", required=True)
    parser.add_argument("--ckpt", required=True)
    return parser.parse_args()


def build(args: argparse.Namespace, seed: int):
    """The fixture's model (tied embeddings, as its --tied), DDP wrapper and optimizer, from ``seed``."""
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = model_config(args.tp, args.pp)
    return wrap(config, gpt_model(config, tied=True), args.dist_opt)


def sharded(model, optimizer, is_loading: bool) -> dict:
    model_state = model.module.sharded_state_dict()
    kwargs = {}
    # From 0.15 the distributed optimizer refuses its old default (flattened-range shards): ask for the
    # fully reshardable layout where the release offers it (Megatron-LM's --dist-ckpt-optim-fully-reshardable).
    if "fully_reshardable" in inspect.getsource(distrib_optimizer):
        kwargs["metadata"] = {"distrib_optim_sharding_type": "fully_reshardable"}
    optimizer_state = optimizer.sharded_state_dict(model_state, is_loading=is_loading, **kwargs)
    return {"model": model_state, "optimizer": optimizer_state}


def main() -> None:
    args = parse()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(args.tp, args.pp)

    model, optimizer = build(args, seed=1234)
    load_full_weights(model.module, torch.load(args.init_from, map_location="cuda"))
    first = train(model, optimizer, range(args.save_at))
    Path(args.ckpt).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded(model, optimizer, is_loading=False), args.ckpt)
    uninterrupted = first + train(model, optimizer, range(args.save_at, args.steps))
    final = {name: p.detach().clone() for name, p in model.module.named_parameters()}

    model, optimizer = build(args, seed=4321)  # other weights: the checkpoint must bring everything back
    state = dist_checkpointing.load(sharded(model, optimizer, is_loading=True), args.ckpt)
    model.module.load_state_dict(state["model"])
    with torch.no_grad():  # upstream's dp_reshardable load copies into fp32 main params that are views of
        optimizer.load_state_dict(state["optimizer"])  # the model's (requires_grad): an autograd error on any device
    resumed = train(model, optimizer, range(args.save_at, args.steps))
    unequal = [name for name, p in model.module.named_parameters() if not torch.equal(p.detach(), final[name])]

    result = {
        "rank": dist.get_rank(),
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "unequal_params": unequal,
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "backend": dist.get_backend(),
    }
    os.write(1, f"RESULT {json.dumps(result)}\n".encode())  # one write: ranks share stdout
    dist.barrier()  # no rank closes its gloo pairs while a peer still sends (an abort in gloo's pair.cc, seen once)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
