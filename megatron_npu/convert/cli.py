"""``megatron-npu convert``: Hugging Face model directories to and from pretrain_gpt.py checkpoints.

    megatron-npu convert to-megatron HF_DIR SAVE_DIR --tp 2 --pp 2 [--vpp 2] [--ep 2] [--seq-length N]
    megatron-npu convert to-hf LOAD_DIR HF_OUT

``to-megatron`` writes ``SAVE_DIR/iter_0000000`` and ``latest_checkpointed_iteration.txt``,
keeps the HF config and tokenizer files in ``SAVE_DIR/hf_config`` (``to-hf`` reads them back,
with any vocabulary rows the import cut), and prints the pretrain_gpt.py flags of the model.
Both ways stream one piece (the embedding, a layer) at a time, with progress on stderr.
Every refusal is checked before torch or megatron-core is imported.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shlex
import shutil
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from megatron_npu.convert.hf_config import (
    ConvertError,
    ModelSpec,
    check_attention_window,
    layout_flags,
    model_spec,
    read_config,
)
from megatron_npu.policy import ConfigError

if TYPE_CHECKING:  # torch-free at import: the refusals come first
    from megatron_npu.convert.hf_io import HFReader

HF_CONFIG_DIR = "hf_config"
# HF vocabulary rows past Megatron's padded count (no token uses them): kept beside the config.
CUT_ROWS = "cut_vocab_rows.safetensors"
# HF tensors kept in another dtype than the model's (DeepSeek-V3's fp32 score-correction bias in a bf16
# model), by name: to-hf writes them back in it
TENSOR_DTYPES = "tensor_dtypes.json"
# Files of a model directory that are not weights: config, generation config, tokenizer.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "*.model",
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-npu convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="direction", required=True)
    to_m = sub.add_parser("to-megatron", help="HF directory -> megatron-core torch_dist checkpoint (iteration 0)")
    to_m.add_argument("hf_dir", help="a Hugging Face model directory (config.json and safetensors)")
    to_m.add_argument("save_dir", help="where the checkpoint goes (the trainer's --load directory)")
    to_m.add_argument("--tp", type=int, default=1, help="tensor parallel size the checkpoint is trained with")
    to_m.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    to_m.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per pipeline rank")
    to_m.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE models)")
    to_m.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="the sequence length you will train at (default: the model's max_position_embeddings)",
    )
    to_m.add_argument(
        "--tokenizer-vocab-size",
        type=int,
        default=None,
        help="tokens of the tokenizer you train with (default: the HF directory's tokenizer, else config vocab_size)",
    )
    to_hf = sub.add_parser("to-hf", help="a checkpoint of any TP x PP (x VPP) -> HF directory (safetensors)")
    to_hf.add_argument("load_dir", help="a --save directory (latest_checkpointed_iteration.txt) or one iter_NNNNNNN")
    to_hf.add_argument("hf_out", help="the Hugging Face directory to write")
    to_hf.add_argument(
        "--hf-config", default=None, help=f"the model's HF directory or config.json (default: LOAD_DIR/{HF_CONFIG_DIR})"
    )
    return p


def tokenizer_vocab(hf_dir: str) -> int | None:
    """len() of the directory's tokenizer, which is the count Megatron's HuggingFaceTokenizer pads."""
    if not glob.glob(os.path.join(hf_dir, "tokenizer*")):
        return None
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(hf_dir))


def suggested_command(
    spec: ModelSpec, save_dir: str, tp: int, pp: int, vpp: int | None, seq_length: int, ep: int = 1
) -> str:
    layout = [*layout_flags(spec, tp=tp, pp=pp, vpp=vpp, ep=ep), "--seq-length", str(seq_length)]
    load = ["--load", save_dir, "--finetune", "--no-load-optim", "--no-load-rng"]
    groups = [spec.flags(), layout, load]
    kept = os.path.join(save_dir, HF_CONFIG_DIR)
    if glob.glob(os.path.join(kept, "tokenizer*")):
        groups.append(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", kept])
    return " \\\n    ".join(shlex.join(g) for g in groups)


def _to_megatron(ns: argparse.Namespace) -> int:
    cfg = read_config(ns.hf_dir)
    vocab = ns.tokenizer_vocab_size if ns.tokenizer_vocab_size is not None else tokenizer_vocab(ns.hf_dir)
    spec = model_spec(cfg, tp=ns.tp, pp=ns.pp, vpp=ns.vpp, ep=ns.ep, tokenizer_vocab=vocab)
    seq_length = ns.seq_length or spec.max_position_embeddings
    check_attention_window(cfg, seq_length)
    from megatron_npu.convert.hf_io import HFReader

    reader = HFReader(ns.hf_dir)  # a missing shard is refused before megatron-core starts
    if reader.has(f"model.layers.{spec.num_layers}.eh_proj.weight"):  # DeepSeek-V3's MTP layer(s)
        spec = model_spec(cfg, tp=ns.tp, pp=ns.pp, vpp=ns.vpp, ep=ns.ep, tokenizer_vocab=vocab, with_mtp=True)
        check_shared_copies(spec, reader, ns.hf_dir)
    from megatron_npu.convert.megatron_io import cut_vocab_rows, hf_to_megatron

    print(f"converting {ns.hf_dir} ({cfg['model_type']}, {spec.num_layers} layers) to {ns.save_dir}", flush=True)
    if spec.padded_vocab_size != spec.vocab_size:
        print(
            f"  vocabulary: {spec.vocab_size} HF rows -> {spec.padded_vocab_size} (the tokenizer's count padded for TP {ns.tp})"
            + (
                f"; the rows past it, which no token uses, are kept in {HF_CONFIG_DIR}/{CUT_ROWS} for the export"
                if spec.padded_vocab_size < spec.vocab_size
                else ""
            )
        )
    hf_to_megatron(spec, reader, ns.save_dir, _progress)
    kept = os.path.join(ns.save_dir, HF_CONFIG_DIR)
    os.makedirs(kept, exist_ok=True)
    cut = cut_vocab_rows(spec, reader)
    if cut:  # the export puts them back, so the HF tensors keep their shape and bits
        from safetensors.torch import save_file

        save_file(cut, os.path.join(kept, CUT_ROWS))
    for pattern in SIDE_FILES:
        for path in glob.glob(os.path.join(ns.hf_dir, pattern)):
            shutil.copy(path, kept)
    other_dtypes = _other_dtypes(spec, reader)
    if other_dtypes:
        with open(os.path.join(kept, TENSOR_DTYPES), "w") as f:
            json.dump(other_dtypes, f, indent=1)
    print(f"peak memory (max RSS): {_peak_rss_gib():.2f} GiB")
    print(
        "train from it with pretrain_gpt.py and these flags (plus your data, batch and schedule flags; a tokenizer "
        f"of {vocab or spec.vocab_size} tokens, which --make-vocab-size-divisible-by pads to {spec.padded_vocab_size}):\n"
    )
    print("    " + suggested_command(spec, ns.save_dir, ns.tp, ns.pp, ns.vpp, seq_length, ns.ep))
    return 0


def check_shared_copies(spec: ModelSpec, reader: HFReader, hf_dir: str) -> None:
    """DeepSeek-V3's MTP layers hold their own ``embed_tokens`` and ``shared_head.head``; megatron-core's MTP
    block uses the main model's embedding and output layer, so the import keeps only those: a copy that differs
    would be dropped, and the model trained would not be the checkpoint's."""
    from megatron_npu.convert.mapping import VOCAB_TENSORS, rules

    for rule in rules(spec):
        if rule.megatron in VOCAB_TENSORS:
            main, *copies = rule.hf
            for copy in copies:
                if not reader.same(copy, main):
                    raise ConvertError(
                        f"{hf_dir}: {copy} differs from {main}: megatron-core's MTP layer shares the main model's "
                        "embedding and output layer, so this checkpoint cannot be trained as it is (give its MTP "
                        "layer the main model's tensors, as DeepSeek-V3's own checkpoints hold them)"
                    )


def _other_dtypes(spec: ModelSpec, reader: HFReader) -> dict[str, str]:
    """HF tensors whose dtype is not the model's, by name (torch's dtype names)."""
    from megatron_npu.convert.hf_io import DTYPES
    from megatron_npu.convert.mapping import rules

    names = {code: str(dtype).removeprefix("torch.") for dtype, code in DTYPES.items()}
    found = {hf: names[reader.dtype(hf)] for rule in rules(spec) for hf in rule.hf if reader.has(hf)}
    return {hf: dtype for hf, dtype in found.items() if dtype != spec.dtype}


def _load_root(load_dir: str) -> tuple[str, int | None]:
    """(--load root, --ckpt-step) for a save directory or one of its iter_NNNNNNN."""
    name = os.path.basename(os.path.normpath(load_dir))
    if name.startswith("iter_") and name[5:].isdigit():
        return os.path.dirname(os.path.normpath(load_dir)), int(name[5:])
    return load_dir, None


def _to_hf(ns: argparse.Namespace) -> int:
    root, step = _load_root(ns.load_dir)
    source = ns.hf_config or os.path.join(root, HF_CONFIG_DIR)
    config_dir = os.path.dirname(source) if source.endswith(".json") else source
    if not os.path.isfile(os.path.join(config_dir, "config.json")):
        raise ConvertError(
            f"no HF config.json in {config_dir}: pass --hf-config with the model's HF directory or config.json"
        )
    cfg = read_config(config_dir)
    spec = model_spec(cfg)
    from megatron.core import dist_checkpointing

    from megatron_npu.convert.hf_io import HFReader, HFWriter
    from megatron_npu.convert.megatron_io import cut_vocab_rows, megatron_to_hf
    from megatron_npu.convert.pieces import Reader
    from megatron_npu.training.checkpointing import checkpoint_dir, read_tracker

    iteration = step if step is not None else read_tracker(root)
    if iteration is None:
        raise ConvertError(f"{root}: no latest_checkpointed_iteration.txt: give the iter_NNNNNNN directory")
    common = dist_checkpointing.load_common_state_dict(checkpoint_dir(root, iteration))
    # The checkpoint's vocabulary rows were padded for its TP; the HF rows come back out of them.
    spec = replace(spec, padded_vocab_size=common["model_shape"]["padded_vocab_size"])
    if any(key.startswith("mtp.") for key in Reader(checkpoint_dir(root, iteration)).metadata.state_dict_metadata):
        spec = replace(spec, mtp_layers=model_spec(cfg, with_mtp=True).mtp_layers)
    writer = HFWriter(ns.hf_out)
    print(f"exporting {checkpoint_dir(root, iteration)} (layout {common['layout']}) to {ns.hf_out}", flush=True)
    cut = {}  # vocabulary rows the import cut: kept beside the checkpoint, or in the HF model itself
    if os.path.isfile(os.path.join(config_dir, CUT_ROWS)):
        from safetensors.torch import load_file

        cut = load_file(os.path.join(config_dir, CUT_ROWS))
    elif glob.glob(os.path.join(config_dir, "*.safetensors")):
        cut = cut_vocab_rows(spec, HFReader(config_dir))
    dtypes = {}
    if os.path.isfile(os.path.join(config_dir, TENSOR_DTYPES)):
        with open(os.path.join(config_dir, TENSOR_DTYPES)) as f:
            dtypes = json.load(f)
    writer.add(megatron_to_hf(spec, checkpoint_dir(root, iteration), _progress, cut, dtypes))
    writer.close()
    for pattern in SIDE_FILES:
        for path in glob.glob(os.path.join(config_dir, pattern)):
            shutil.copy(path, ns.hf_out)
    with open(os.path.join(ns.hf_out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    print(f"peak memory (max RSS): {_peak_rss_gib():.2f} GiB")
    return 0


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB on Linux


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        return _to_megatron(ns) if ns.direction == "to-megatron" else _to_hf(ns)
    except (ConvertError, ConfigError) as error:  # the trainer's checks (a checkpoint of another model) too
        print(f"megatron-npu convert: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
