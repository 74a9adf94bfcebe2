"""tests/fixtures/gpu_style_gpt.py's GPU-written training, with a megatron-core dist-checkpoint resume.

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
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, distrib_optimizer, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

import megatron_npu  # noqa: F401  (the only change to a GPU script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from gpu_style_gpt import GBS, MBS, SEQ, VOCAB, batches, load_full_weights  # noqa: E402


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
    """Model (tied embeddings, as the fixture's --tied), DDP wrapper and optimizer."""
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=args.dist_opt, overlap_grad_reduce=args.dist_opt
    )
    model = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0, use_distributed_optimizer=args.dist_opt
        ),
        [model],
    )
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer


def train(model, optimizer, steps: range) -> list[float]:
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    forward_backward = get_forward_backward_func()

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(output_tensor):
            loss = (output_tensor.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    losses = []
    for step in steps:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = forward_backward(
            forward_step_func=forward_step,
            data_iterator=batches(step, dp_rank, dp),
            model=[model],
            num_microbatches=GBS // (MBS * dp),
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        optimizer.step()
        if parallel_state.is_pipeline_last_stage():
            local = torch.stack([r["lm loss"] for r in reports]).mean()
            dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
            losses.append((local / dp).item())
    return losses


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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
