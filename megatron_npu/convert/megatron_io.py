"""The megatron-core side: pretrain_gpt.py's own model, filled from or read into HF tensors.

One process builds the whole model once (TP1, PP1, on the host) with pretrain_gpt.py's
``model_provider`` and saves it with the trainer's ``save_checkpoint``. dist-checkpointing
stores global tensors (each layer under its global number, QKV by whole query groups), so
the checkpoint loads under any TP x PP x VPP whose vocabulary padding matches; the export
loads any TP x PP (x VPP) checkpoint the same way, resharded by dist-checkpointing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_npu.convert.hf_config import ModelSpec
from megatron_npu.convert.hf_io import HFReader
from megatron_npu.convert.mapping import rules
from megatron_npu.training.arguments import parse_args
from megatron_npu.training.checkpointing import load_checkpoint, save_checkpoint
from megatron_npu.training.global_vars import set_global
from megatron_npu.training.initialize import initialize_distributed

PRETRAIN_GPT = Path(__file__).resolve().parents[2] / "pretrain_gpt.py"
Progress = Callable[[str], None]


def trainer_args(
    spec: ModelSpec, *, tp: int = 1, pp: int = 1, vpp: int | None = None, extra: tuple[str, ...] = ()
) -> argparse.Namespace:
    """pretrain_gpt.py's arguments for ``spec`` under a layout, as its parser derives them."""
    argv = [
        *spec.flags(),
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
        "--seq-length",
        str(min(spec.max_position_embeddings, 4096)),
        "--micro-batch-size",
        "1",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(spec.padded_vocab_size - 1),
        "--use-cpu-initialization",
        "--no-initialization",
        "--train-iters",
        "1",
        "--lr",
        "0",
    ]
    if vpp:
        argv += ["--num-layers-per-virtual-pipeline-stage", str(spec.num_layers // (pp * vpp))]
    # world size: $WORLD_SIZE under torchrun, else 1 (the converter's own process)
    args = parse_args([*argv, *extra], check_paths=False)
    args.padded_vocab_size = spec.padded_vocab_size  # the tokenizer's count padded for the target TP
    return args


def model_provider() -> Callable[..., torch.nn.Module]:
    """pretrain_gpt.py's own builder, so the converted layout is the one the trainer loads."""
    module_spec = importlib.util.spec_from_file_location("pretrain_gpt", PRETRAIN_GPT)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.model_provider


def single_process(args: argparse.Namespace) -> None:
    """A world of one (the accelerator's backend) for megatron-core's parallel state."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    initialize_distributed(args)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def whole_model(spec: ModelSpec) -> tuple[torch.nn.Module, argparse.Namespace]:
    args = trainer_args(spec)
    if not dist.is_initialized():
        single_process(args)
    set_global("args", args)
    return model_provider()(pre_process=True, post_process=True), args


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}


def hf_to_megatron(spec: ModelSpec, reader: HFReader, out_dir: str, progress: Progress) -> str:
    """Fill the model tensor by tensor from the HF files, then the trainer's save (iteration 0)."""
    model, args = whole_model(spec)
    params = _params(model)
    todo = list(rules(spec))
    unmapped = set(params) - {r.megatron for r in todo}
    if unmapped:
        raise RuntimeError(f"megatron-core tensors with no HF source: {sorted(unmapped)}")
    start = time.monotonic()
    with torch.no_grad():
        for n, rule in enumerate(todo, 1):
            target = params[rule.megatron]
            value = rule.to_megatron([reader.get(name) for name in rule.hf])
            if value.shape != target.shape:
                raise RuntimeError(
                    f"{rule.megatron}: HF gives {tuple(value.shape)}, megatron-core has {tuple(target.shape)}"
                )
            target.copy_(value)
            if n % 50 == 0 or n == len(todo):
                progress(f"  {n}/{len(todo)} tensors ({time.monotonic() - start:.0f} s)")
    args.save, args.no_save_optim, args.no_save_rng = out_dir, True, True
    return save_checkpoint(0, [model], None, None, args)


def megatron_to_hf(
    spec: ModelSpec, load_dir: str, iteration: int, progress: Progress
) -> Iterator[tuple[str, torch.Tensor]]:
    """Load a checkpoint of any layout into the whole model; yield HF tensors one rule at a time."""
    model, args = whole_model(spec)
    # weights only: no optimizer, RNG or data position
    args.load, args.ckpt_step, args.finetune = load_dir, iteration, True
    load_checkpoint([model], None, None, args)
    progress(f"  loaded iteration {iteration} of {load_dir} into one whole model")
    params = _params(model)
    dtype = getattr(torch, spec.dtype)  # the model keeps some tensors (norm scales) in fp32 under --bf16
    for rule in rules(spec):
        with torch.no_grad():
            tensors = rule.to_hf(params[rule.megatron].detach())
            yield from zip(rule.hf, [t.to(dtype) for t in tensors], strict=True)
