"""The megatron-core side: pretrain_gpt.py's own model, filled from or read into HF tensors.

The converter builds pretrain_gpt.py's whole model (TP1, PP1: ``spec.gpt_model``, what its
``model_provider`` builds) on the meta device, from the model's sections and a layout, in a world of
one: that gives every tensor's name, shape and dist-checkpointing key without memory.
dist-checkpointing stores global tensors (each layer a chunk of its stacked tensor, QKV by
whole query groups), so the checkpoint loads under any TP x PP x VPP whose vocabulary padding
matches, and the export reads any TP x PP (x VPP) checkpoint, resharded by dist-checkpointing.
Both ways stream by piece (the embedding, one layer, the output): memory holds one piece.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_npu.convert.hf_config import ModelSpec, layout_flags
from megatron_npu.convert.hf_io import HFReader
from megatron_npu.convert.mapping import VOCAB_TENSORS, rules, sliced
from megatron_npu.convert.pieces import Pieces, Reader, layer_stacked
from megatron_npu.layout.model_shape import ModelShape
from megatron_npu.layout.parallel_dims import ParallelDims
from megatron_npu.spec import gpt_model
from megatron_npu.training.arguments import parse_args
from megatron_npu.training.checkpoint_format import CheckpointedRun
from megatron_npu.training.checkpointing import checkpoint_dir, save_checkpoint
from megatron_npu.training.run_state import RunState
from megatron_npu.training.sections import (
    CheckpointSection,
    DistributedSection,
    MixedPrecisionSection,
    ModelSection,
    MoeSection,
    Section,
    TrainingSection,
    add_section_arguments,
)

Progress = Callable[[str], None]


# the sections the model flags (ModelSpec.flags) belong to
MODEL_FLAG_SECTIONS: tuple[type[Section], ...] = (ModelSection, MoeSection, MixedPrecisionSection)
PARAMS_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # else float32


@dataclass(frozen=True)
class ModelSections:
    """What a model is built from, as ``training.config.ModelSettings`` asks: its sections and its layout."""

    model: ModelSection
    moe: MoeSection
    precision: MixedPrecisionSection
    training: TrainingSection
    distributed: DistributedSection
    checkpoint: CheckpointSection
    parallel: ParallelDims


def model_sections(spec: ModelSpec) -> ModelSections:
    """The sections of ``spec``'s model at TP1 x PP1: its printed flags read by the sections' own
    argument groups (no trainer start-up, no other flag), with what validation derives from them."""
    model, moe, precision = _flag_sections(spec.flags())
    shape = ModelShape.from_args(model)  # Megatron-LM's ffn / kv-channel / query-group defaults
    model = model.replace(
        ffn_hidden_size=shape.ffn_hidden_size, kv_channels=shape.kv_channels, num_query_groups=shape.num_query_groups
    )
    training = TrainingSection(
        use_cpu_initialization=True,  # the meta model: no device
        apply_rope_fusion=model.position_embedding_type == "rope",  # validation: fused RoPE only with RoPE
        bias_gelu_fusion=model.add_bias_linear,  # validation: no bias, no bias-GeLU fusion
    )
    layout = ParallelDims(world_size=1, num_layers=model.num_layers, num_experts=moe.num_experts or 0)
    return ModelSections(
        model=model,
        moe=moe,
        precision=precision,
        training=training,
        # validation: only the interleaved schedule overlaps p2p
        distributed=DistributedSection(overlap_p2p_comm=False, align_param_gather=False),
        checkpoint=CheckpointSection(perform_initialization=False),  # the meta model: nothing to initialise
        parallel=layout,
    )


def _flag_sections(flags: list[str]) -> tuple[ModelSection, MoeSection, MixedPrecisionSection]:
    parser = argparse.ArgumentParser(prog="ModelSpec.flags", add_help=False, allow_abbrev=False)
    for section in MODEL_FLAG_SECTIONS:
        add_section_arguments(parser, section, section.__name__)
    values = parser.parse_args(flags)
    values.params_dtype = next((d for flag, d in PARAMS_DTYPES.items() if getattr(values, flag)), "float32")
    model, moe, precision = (section.from_values(values) for section in MODEL_FLAG_SECTIONS)
    return model, moe, precision


def args_record(
    spec: ModelSpec, *, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1, extra: tuple[str, ...] = ()
) -> argparse.Namespace:
    """The Megatron-LM ``args`` a converted checkpoint records (its loader checks them against the run's):
    pretrain_gpt.py's arguments for ``spec`` under a layout, as its parser derives them. As Megatron-LM's own
    converters do, a whole parsed namespace: the record is every flag, not the model's sections alone."""
    argv = [
        *spec.flags(),
        *layout_flags(spec, tp=tp, pp=pp, vpp=vpp, ep=ep),
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
    # world size: $WORLD_SIZE under torchrun, else 1 (the converter's own process)
    args = parse_args([*argv, *extra], check_paths=False)
    args.padded_vocab_size = spec.padded_vocab_size  # the tokenizer's count padded for the target TP
    return args


def world_of_one() -> None:
    """What building a model needs of process groups. megatron-core has no single-process mode: its
    layers read their tensor / pipeline / expert group sizes and ranks from parallel_state at
    construction, and dist-checkpointing's save gathers over a process group; so a gloo world of
    one, its store in memory (no port, no device), with TP1 x PP1 groups, and nothing else."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()


def meta_model(spec: ModelSpec) -> torch.nn.Module:
    """pretrain_gpt.py's whole model (TP1, PP1) on the meta device: its names, shapes and
    sharded state dict (global keys and chunks) without memory for its weights."""
    world_of_one()
    with torch.device("meta"):
        return gpt_model(model_sections(spec), spec.padded_vocab_size)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}


def _piece_of(name: str) -> str:
    """The piece a state-dict entry is saved or loaded with: its layer, or the top-level module."""
    if name.startswith(("decoder.layers.", "mtp.layers.")):
        return ".".join(name.split(".")[:3])
    return "output" if name.startswith(("decoder.final_layernorm", "output_layer")) else name.split(".")[0]


def _pieces(model: torch.nn.Module) -> dict[str, dict]:
    """The model's sharded state dict split by piece, in model order (``output`` last)."""
    pieces: dict[str, dict] = {}
    for name, entry in model.sharded_state_dict().items():
        pieces.setdefault(_piece_of(name), {})[name] = entry
    pieces["output"] = pieces.pop("output")
    return pieces


def _with_data(entry: object, data: torch.Tensor) -> object:
    if data.shape != entry.data.shape:
        raise RuntimeError(f"{entry.key}: HF gives {tuple(data.shape)}, megatron-core has {tuple(entry.data.shape)}")
    return replace(entry, data=data)


def cut_vocab_rows(spec: ModelSpec, reader: HFReader) -> dict[str, torch.Tensor]:
    """The HF vocabulary rows past Megatron's (rows no token of the tokenizer uses), by HF name."""
    if spec.padded_vocab_size >= spec.vocab_size:
        return {}
    names = [r.hf[0] for r in rules(spec) if r.megatron in VOCAB_TENSORS]
    return {name: reader.get(name)[spec.padded_vocab_size :].clone() for name in names}


class _Piece:
    """What the trainer's save_checkpoint asks a model for: here, one piece of its sharded state."""

    def __init__(self, sharded_state_dict: dict) -> None:
        self.sharded = sharded_state_dict

    def sharded_state_dict(self, metadata: dict | None = None) -> dict:
        # metadata (the DP x CP group the trainer passes) sets replica ids: one process owns every chunk
        return self.sharded


def hf_to_megatron(spec: ModelSpec, reader: HFReader, out_dir: str, progress: Progress) -> str:
    """Each piece (the embedding, a layer, the output) filled from the HF files and saved on
    its own; the last one by the trainer's save_checkpoint (iteration 0), which merges them."""
    model = meta_model(spec)
    params = _params(model)
    by_name = {r.megatron: r for r in rules(spec)}
    if set(params) != set(by_name):
        raise RuntimeError(
            f"megatron-core tensors with no HF source: {sorted(set(params) - set(by_name))}; "
            f"mapped tensors the model lacks: {sorted(set(by_name) - set(params))}"
        )
    pieces = _pieces(model)
    staging = Pieces(os.path.join(out_dir, "iter_0000000.pieces"))
    start, done = time.monotonic(), 0
    for n, (piece, entries) in enumerate(pieces.items(), 1):
        filled = {}
        for name, entry in entries.items():
            rule = by_name.get(name)
            if rule is not None:  # else an _extra_state object, saved as it is
                with torch.no_grad():
                    value = rule.to_megatron([reader.get(hf) for hf in rule.hf]).to(params[name].dtype)
                entry, done = _with_data(entry, value), done + 1
            filled[name] = entry
        if n < len(pieces):
            staging.save({"model": filled})
        else:
            args = args_record(spec)
            args.save, args.no_save_optim, args.no_save_rng = out_dir, True, True
            checkpoint = args.checkpoint.replace(save=out_dir, no_save_optim=True, no_save_rng=True)
            run = CheckpointedRun.from_sections(
                args.model, args.distributed, args.init, args.fsdp, padded_vocab_size=args.padded_vocab_size
            )
            record = args.values()  # the checkpoint's Megatron-LM ``args``
            directory = save_checkpoint(
                RunState(), [_Piece(filled)], None, None, checkpoint, run, record, in_save=_merge(staging, out_dir)
            )
        progress(f"  {piece}: {done}/{len(by_name)} tensors ({time.monotonic() - start:.0f} s)")
    return directory


def _merge(staging: Pieces, out_dir: str) -> Callable[[int], None]:
    return lambda iteration: staging.merge(checkpoint_dir(out_dir, iteration) + ".partial")


def megatron_to_hf(
    spec: ModelSpec,
    directory: str,
    progress: Progress,
    cut: dict[str, torch.Tensor] | None = None,
    dtypes: dict[str, str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Read a checkpoint of any layout piece by piece (each tensor's chunks of one layer,
    whatever TP x PP saved them); yield HF tensors one rule at a time. ``cut``: the vocabulary
    rows the import cut (``cut_vocab_rows``), put back; ``dtypes``: HF tensors kept in another
    dtype than the model's, by name."""
    other = {name: getattr(torch, dtype) for name, dtype in (dtypes or {}).items()}
    model = meta_model(spec)
    params = _params(model)
    by_name = {r.megatron: r for r in rules(spec, cut)}
    reader = Reader(directory)
    dtype = getattr(torch, spec.dtype)  # the model keeps some tensors (norm scales) in fp32 under --bf16
    start, done = time.monotonic(), 0
    for piece, entries in _pieces(model).items():
        # per checkpoint key: (layer offset, target); per name: (key, expert index or None)
        targets: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
        of: dict[str, tuple[str, int | None]] = {}
        for name, entry in entries.items():
            if name in by_name:
                expert = _expert_of(name)
                at = (int(name.split(".")[2]),) if layer_stacked(entry.key) else ()
                shape = tuple(params[name].shape)
                if expert is not None:  # one tensor of the layer's experts on a leading expert axis
                    shape = (spec.moe.num_experts, *shape)
                if reader.shape(entry.key, len(at)) != shape:
                    raise RuntimeError(
                        f"{directory}: {entry.key} is {reader.shape(entry.key, len(at))} per layer, "
                        f"the model's {name} is {shape}"
                    )
                if entry.key not in targets:
                    targets[entry.key] = (at, torch.empty(shape, dtype=params[name].dtype))
                of[name] = (entry.key, expert)
        reader.load(targets)
        rows: dict[str, dict[int, torch.Tensor]] = {}  # HF tensors stacked over experts (gpt-oss), row by row
        for name, (key, expert) in of.items():
            target = targets[key][1]
            with torch.no_grad():
                tensors = by_name[name].to_hf(target if expert is None else target[expert])
            for hf_name, tensor in zip(by_name[name].hf, tensors, strict=True):
                tensor, (base, row) = tensor.to(other.get(hf_name, dtype)), sliced(hf_name)
                if row is None:
                    yield hf_name, tensor
                    continue
                rows.setdefault(base, {})[row] = tensor
                if len(rows[base]) == spec.moe.num_experts:  # a layer's experts are all in one piece
                    stacked = rows.pop(base)
                    yield base, torch.stack([stacked[e] for e in range(spec.moe.num_experts)])
            done += 1
        if rows:
            raise RuntimeError(f"{directory}: experts missing from {sorted(rows)}")
        progress(f"  {piece}: {done}/{len(by_name)} tensors ({time.monotonic() - start:.0f} s)")


def _expert_of(name: str) -> int | None:
    """The (global) expert index of a SequentialMLP expert's tensor, from its state-dict name."""
    parts = name.split(".")
    if "local_experts" not in parts:
        return None
    return int(parts[parts.index("local_experts") + 1])
