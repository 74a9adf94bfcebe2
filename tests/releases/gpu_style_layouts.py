"""tests/fixtures/gpu_style_gpt.py's GPU-written training under three layouts in ONE launch (4 ranks).

The release matrix's quick check (tests/releases/test_release_quick.py): megatron-core's import is paid once
for what the full matrix checks in three launches. In one process group, model parallelism re-initialised
between the parts (``destroy_model_parallel``, as megatron-core's own unit tests do):
  1. reference  TP1 x PP1 (DP4) from seed 1234; its initial weights kept, gathered to full shapes;
  2. tp2pp2     TP2 x PP2 from those weights;
  3. pp2dp2     PP2 x DP2 with the distributed optimizer from those weights, saving a megatron-core
                dist-checkpoint after ``--save-at`` steps, then the model and optimizer built again from
                another seed, loaded, and trained the remaining steps (gpu_style_resume.py's procedure).
Every rank prints one RESULT line: each part's losses (empty off the last stage), the resumed ones and the
parameters that ended unequal.

Usage: torchrun --nproc_per_node 4 gpu_style_layouts.py --steps S --save-at K --ckpt DIR
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel

import megatron_npu  # noqa: F401  (the only change to a GPU script)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from gpu_style_gpt import full_weights, gpt_model, load_full_weights, model_config, train, wrap  # noqa: E402
from gpu_style_resume import sharded  # noqa: E402


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--ckpt", required=True)
    return parser.parse_args()


def layout(tp: int, pp: int) -> None:
    """Model parallelism TP x PP over the whole world (what is left is DP), replacing the previous layout."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)


def build(tp: int, pp: int, seed: int, dist_opt: bool, weights: dict | None):
    """The fixture's model (tied embeddings), from ``seed`` or from full-shape ``weights``; DDP and optimizer."""
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = model_config(tp, pp)
    model = gpt_model(config, tied=True)
    if weights is not None:
        load_full_weights(model, weights)
    return wrap(config, model, dist_opt)


def reference(steps: int) -> tuple[dict, list[float]]:
    layout(1, 1)
    model, optimizer = build(1, 1, seed=1234, dist_opt=False, weights=None)
    weights = full_weights(model.module)  # TP1: every rank holds the whole model
    return weights, train(model, optimizer, range(steps))


def tp2pp2(weights: dict, steps: int) -> list[float]:
    layout(2, 2)
    model, optimizer = build(2, 2, seed=1234, dist_opt=False, weights=weights)
    return train(model, optimizer, range(steps))


def pp2dp2_resumed(weights: dict, steps: int, save_at: int, ckpt: str) -> dict:
    """gpu_style_resume.py's procedure under PP2 x DP2 with the distributed optimizer."""
    layout(1, 2)
    model, optimizer = build(1, 2, seed=1234, dist_opt=True, weights=weights)
    first = train(model, optimizer, range(save_at))
    Path(ckpt).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded(model, optimizer, is_loading=False), ckpt)
    uninterrupted = first + train(model, optimizer, range(save_at, steps))
    final = {name: p.detach().clone() for name, p in model.module.named_parameters()}

    model, optimizer = build(1, 2, seed=4321, dist_opt=True, weights=None)  # the checkpoint must
    state = dist_checkpointing.load(sharded(model, optimizer, is_loading=True), ckpt)  # bring everything back
    model.module.load_state_dict(state["model"])
    with torch.no_grad():  # as gpu_style_resume.py: the dp_reshardable load copies into views of the model's
        optimizer.load_state_dict(state["optimizer"])
    resumed = train(model, optimizer, range(save_at, steps))
    unequal = [name for name, p in model.module.named_parameters() if not torch.equal(p.detach(), final[name])]
    return {
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "unequal_params": unequal,
        "dp_rank": parallel_state.get_data_parallel_rank(),
    }


def main() -> None:
    args = parse()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.set_num_threads(1)
    weights, reference_losses = reference(args.steps)
    result = {
        "rank": dist.get_rank(),
        "backend": dist.get_backend(),
        "reference": reference_losses,
        "tp2pp2": tp2pp2(weights, args.steps),
        **pp2dp2_resumed(weights, args.steps, args.save_at, args.ckpt),
    }
    os.write(1, f"RESULT {json.dumps(result)}\n".encode())  # one write: ranks share stdout
    dist.barrier()  # no rank closes its gloo pairs while a peer still sends (an abort in gloo's pair.cc, seen once)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
