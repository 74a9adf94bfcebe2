"""A megatron-core GPT training script written the GPU way, plus ``import megatron_npu``.

It calls ``init_process_group("nccl")``, ``torch.cuda.set_device``, ``.cuda()`` on
batches and builds layers with the default ``use_cpu_initialization=False``:
nothing in it knows about the cpu or npu target. Every rank prints one RESULT line.

Usage: torchrun --nproc_per_node N gpu_style_gpt.py --tp T --pp P [--dist-opt] [--tied]
       [--steps S] [--init-from weights.pt] [--save-init weights.pt] [--rng-probe]
       [--repeat-data K]
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

import megatron_npu  # noqa: F401  (the only change to a GPU script)

VOCAB, SEQ, MBS, GBS = 128, 32, 2, 8


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dist-opt", action="store_true")
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--init-from")
    parser.add_argument("--save-init")
    parser.add_argument("--rng-probe", action="store_true")
    parser.add_argument("--repeat-data", type=int, default=0, help="cycle over this many global batches")
    return parser.parse_args()


def batches(step: int, dp_rank: int, dp: int):
    """The global batch of ``step``, split over DP ranks; same tokens for every layout."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GBS, SEQ + 1), generator=generator)
    per_rank = GBS // dp
    mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    for start in range(0, per_rank, MBS):
        chunk = mine[start : start + MBS]
        yield {
            "tokens": chunk[:, :-1].contiguous().cuda(),
            "labels": chunk[:, 1:].contiguous().cuda(),
            "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, -1).cuda(),
            "loss_mask": torch.ones(MBS, SEQ).cuda(),
        }


def full_weights(model: GPTModel) -> dict:
    """Gather this stage's parameters to their full (TP=1) shapes, by layer number."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for name, param in model.named_parameters():
        tensor = param.detach()
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(parts, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
            tensor = torch.cat(parts, dim=param.partition_dim)
        out[global_name(model, name)] = tensor.clone()
    return out


def global_name(model: GPTModel, name: str) -> str:
    """Parameter name with the global layer number (stable across PP layouts)."""
    if ".layers." in name:
        head, rest = name.split(".layers.", 1)
        index, tail = rest.split(".", 1)
        offset = model.decoder.layers[0].layer_number - 1
        return f"{head}.layers.{int(index) + offset}.{tail}"
    return name


def load_full_weights(model: GPTModel, weights: dict) -> None:
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for name, param in model.named_parameters():
        key = global_name(model, name)
        if key not in weights and key == "output_layer.weight":
            key = "embedding.word_embeddings.weight"  # tied output under PP
        full = weights[key]
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            full = torch.chunk(full, tp, dim=param.partition_dim)[tp_rank]
        param.data.copy_(full)


def main() -> None:
    args = parse()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(args.tp, args.pp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()

    config = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=args.tied,
        position_embedding_type="learned_absolute",
    )
    if args.init_from:
        load_full_weights(model, torch.load(args.init_from, map_location="cuda"))
    if args.save_init:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, full_weights(model) if dp_rank == 0 else {})
        if dist.get_rank() == 0:
            merged = {k: v for part in gathered for k, v in part.items()}
            torch.save(merged, args.save_init)

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=args.dist_opt, overlap_grad_reduce=args.dist_opt
    )
    model = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0, use_distributed_optimizer=args.dist_opt),
        [model],
    )
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(output_tensor):
            loss = (output_tensor.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    losses = []
    for step in range(args.steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = forward_backward(
            forward_step_func=forward_step, data_iterator=batches(step % args.repeat_data if args.repeat_data else step, dp_rank, dp), model=[model],
            num_microbatches=GBS // (MBS * dp), seq_length=SEQ, micro_batch_size=MBS, forward_only=False,
        )  # fmt: skip
        optimizer.step()
        if parallel_state.is_pipeline_last_stage():
            local = torch.stack([r["lm loss"] for r in reports]).mean()
            dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
            losses.append((local / dp).item())

    result = {"rank": dist.get_rank(), "losses": losses, "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
              "dp_rank": dp_rank, "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
              "backend": dist.get_backend()}  # fmt: skip
    if args.rng_probe:
        result["rng"] = rng_probe()
    os.write(1, f"RESULT {json.dumps(result)}\n".encode())  # one write: ranks share stdout
    dist.destroy_process_group()


def rng_probe() -> dict:
    """Dropout masks drawn inside and outside the tracker's model-parallel fork."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    ones = torch.ones(4096).cuda()
    with tracker.fork():
        inside = torch.nn.functional.dropout(ones, 0.5).nonzero().flatten()[:64].tolist()
    outside = torch.nn.functional.dropout(ones, 0.5).nonzero().flatten()[:64].tolist()
    with tracker.fork():
        inside_again = torch.nn.functional.dropout(ones, 0.5).nonzero().flatten()[:64].tolist()
    return {"inside": inside, "outside": outside, "inside_again": inside_again}


if __name__ == "__main__":
    main()
