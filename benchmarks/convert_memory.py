"""Peak memory of `megatron-npu convert` on a ~1 B-parameter LLaMA-shaped model, both ways.

Writes a random bf16 model with LLaMA-3.2-1B's shape (16 layers, hidden 2048, 32 heads in
8 query groups, ffn 8192, vocab 128256, tied embeddings: 1.24 B parameters, 2.5 GB) as
safetensors shards, tensor by tensor (no transformers model in memory), then runs
``to-megatron`` (TP2 x PP2) and ``to-hf`` each in its own process and prints that
process's peak RSS (ru_maxrss) next to the model's size. ``--before TREE`` measures another
source tree of the project in the same run, after this one (``git archive REV | tar -x -C TREE``,
then ``ln -s ../patches TREE/megatron_npu/patches``: the editable install maps that package).

    python benchmarks/convert_memory.py [--work DIR] [--layers 16] [--before TREE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file

SHAPE = {"hidden": 2048, "heads": 32, "groups": 8, "ffn": 8192, "vocab": 128256}


def write_model(path: str, layers: int) -> int:
    """A random LLaMA-3.2-1B-shaped HF directory; returns its bytes."""
    os.makedirs(path, exist_ok=True)
    h, d = SHAPE["hidden"], SHAPE["hidden"] // SHAPE["heads"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": SHAPE["ffn"],
        "num_hidden_layers": layers,
        "num_attention_heads": SHAPE["heads"],
        "num_key_value_heads": SHAPE["groups"],
        "vocab_size": SHAPE["vocab"],
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "dtype": "bfloat16",
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    weight_map, total = {}, 0

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape) * 0.02).to(torch.bfloat16)

    shard("embed.safetensors", {"model.embed_tokens.weight": rand(SHAPE["vocab"], h), "model.norm.weight": rand(h)})
    for i in range(layers):
        p = f"model.layers.{i}."
        shard(
            f"layer-{i:03d}.safetensors",
            {
                p + "input_layernorm.weight": rand(h),
                p + "post_attention_layernorm.weight": rand(h),
                p + "self_attn.q_proj.weight": rand(h, h),
                p + "self_attn.k_proj.weight": rand(SHAPE["groups"] * d, h),
                p + "self_attn.v_proj.weight": rand(SHAPE["groups"] * d, h),
                p + "self_attn.o_proj.weight": rand(h, h),
                p + "mlp.gate_proj.weight": rand(SHAPE["ffn"], h),
                p + "mlp.up_proj.weight": rand(SHAPE["ffn"], h),
                p + "mlp.down_proj.weight": rand(h, SHAPE["ffn"]),
            },
        )
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def peak_of(command: list[str], tree: str | None = None) -> tuple[float, float]:
    """(peak RSS GiB, seconds) of one child process: wait4 gives that child's own rusage."""
    start = time.monotonic()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
    # in the tree's folder too: `python -m` puts the working directory first on the path
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tree)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {child.returncode}")
    return usage.ru_maxrss / (1 << 20), time.monotonic() - start  # KiB on Linux


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=None, help="directory for the model and checkpoints (default: a temporary one)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--before", default=None, help="another source tree of megatron-npu to measure in the same run")
    p.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args()
    work = ns.work or tempfile.mkdtemp(prefix="convert-memory-")
    if ns.write_only:
        write_model(os.path.join(work, "hf"), ns.layers)
        return
    # The model is written by a child: Linux carries a process's peak RSS across exec into the
    # processes it starts, so a parent that held the random model would mask the converters' peaks.
    subprocess.run([sys.executable, __file__, "--work", work, "--layers", str(ns.layers), "--write-only"], check=True)
    with open(os.path.join(work, "hf", "model.safetensors.index.json")) as f:
        size = json.load(f)["metadata"]["total_size"]
    params = size // 2
    print(f"model: {params / 1e9:.2f} B parameters, {size / (1 << 30):.2f} GiB bf16 in {work}/hf")
    convert = [sys.executable, "-m", "megatron_npu.cli", "convert"]
    trees = {"this tree": None, **({f"before ({ns.before})": ns.before} if ns.before else {})}
    for n, (name, tree) in enumerate(trees.items()):
        out = os.path.join(work, f"megatron-{n}")
        peak, secs = peak_of([*convert, "to-megatron", f"{work}/hf", out, "--tp", "2", "--pp", "2"], tree)
        print(f"{name}: to-megatron: peak RSS {peak:.2f} GiB ({peak * (1 << 30) / size:.2f}x the model), {secs:.0f} s")
        peak, secs = peak_of([*convert, "to-hf", out, f"{work}/back-{n}"], tree)
        print(f"{name}: to-hf:       peak RSS {peak:.2f} GiB ({peak * (1 << 30) / size:.2f}x the model), {secs:.0f} s")


if __name__ == "__main__":
    main()
