"""Peak memory of `megatron-npu convert` on a ~1 B-parameter LLaMA-shaped model (or, with
``--moe``, a Qwen3-MoE-shaped one), both ways.

Writes a random bf16 model with LLaMA-3.2-1B's shape (16 layers, hidden 2048, 32 heads in
8 query groups, ffn 8192, vocab 128256, tied embeddings: 1.24 B parameters, 2.5 GB) as
safetensors shards, tensor by tensor (no transformers model in memory), then runs
``to-megatron`` (TP2 x PP2) and ``to-hf`` each in its own process and prints that
process's peak RSS (ru_maxrss) next to the model's size and its largest shard and layer (the
converters hold about one layer's tensors). ``--moe``: a Qwen3-MoE-shaped model (hidden 2048,
32 heads in 4 query groups, QK norm, 32 experts of ffn 768, top-4, vocab 32000, untied: 0.67 B
parameters at 8 layers, one shard per layer), converted TP2 x EP2. ``--before TREE`` measures another
source tree of the project in the same run, after this one (``git archive REV | tar -x -C TREE``,
then ``ln -s ../patches TREE/megatron_npu/patches``: the editable install maps that package).

    python benchmarks/convert_memory.py [--work DIR] [--layers 16] [--moe] [--before TREE]
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
MOE_SHAPE = {"hidden": 2048, "heads": 32, "groups": 4, "head_dim": 128, "experts": 32, "ffn": 768, "vocab": 32000}


def rand(*shape: int) -> torch.Tensor:
    return (torch.randn(*shape) * 0.02).to(torch.bfloat16)


class ShardWriter:
    """Writes an HF directory's safetensors shards one call each, then its index (the weight map and total size)."""

    def __init__(self, path: str) -> None:
        self.path, self.weight_map, self.total = path, {}, 0

    def __call__(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, os.path.join(self.path, name), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(tensors, name))
        self.total += sum(t.numel() * t.element_size() for t in tensors.values())

    def write_index(self) -> int:
        """The index file; returns the model's bytes."""
        with open(os.path.join(self.path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": self.weight_map}, f)
        return self.total


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
    shard = ShardWriter(path)
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
    return shard.write_index()


def write_moe_model(path: str, layers: int) -> int:
    """A random Qwen3-MoE-shaped HF directory (experts in every layer, one shard per layer); returns its bytes."""
    os.makedirs(path, exist_ok=True)
    m = MOE_SHAPE
    h, d = m["hidden"], m["head_dim"]
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": h,
        "intermediate_size": 6144,
        "moe_intermediate_size": m["ffn"],
        "num_experts": m["experts"],
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "num_hidden_layers": layers,
        "num_attention_heads": m["heads"],
        "num_key_value_heads": m["groups"],
        "head_dim": d,
        "vocab_size": m["vocab"],
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    shard = ShardWriter(path)
    shard("embed.safetensors", {"model.embed_tokens.weight": rand(m["vocab"], h), "model.norm.weight": rand(h)})
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors = {
            p + "input_layernorm.weight": rand(h),
            p + "post_attention_layernorm.weight": rand(h),
            p + "self_attn.q_proj.weight": rand(m["heads"] * d, h),
            p + "self_attn.k_proj.weight": rand(m["groups"] * d, h),
            p + "self_attn.v_proj.weight": rand(m["groups"] * d, h),
            p + "self_attn.o_proj.weight": rand(h, m["heads"] * d),
            p + "self_attn.q_norm.weight": rand(d),
            p + "self_attn.k_norm.weight": rand(d),
            p + "mlp.gate.weight": rand(m["experts"], h),
        }
        for e in range(m["experts"]):
            for proj, shape in (("gate_proj", (m["ffn"], h)), ("up_proj", (m["ffn"], h)), ("down_proj", (h, m["ffn"]))):
                tensors[f"{p}mlp.experts.{e}.{proj}.weight"] = rand(*shape)
        shard(f"layer-{i:03d}.safetensors", tensors)
    shard("head.safetensors", {"lm_head.weight": rand(m["vocab"], h)})
    return shard.write_index()


def largest_shard(path: str) -> int:
    return max(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))


def peak_of(command: list[str], tree: str | None = None) -> tuple[float, float]:
    """(peak RSS GiB, seconds) of one child process: wait4 gives that child's own rusage."""
    start = time.monotonic()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
    # in the tree's folder too: `python -m` puts the working directory first on the path
    # stderr passes through: the converter's progress, one line per piece
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env, cwd=tree)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {child.returncode}")
    return usage.ru_maxrss / (1 << 20), time.monotonic() - start  # KiB on Linux


def ratios(peak_gib: float, size: int, shard: int) -> str:
    peak = peak_gib * (1 << 30)
    return f"{peak / size:.2f}x the model, {peak / shard:.2f}x its largest shard"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=None, help="directory for the model and checkpoints (default: a temporary one)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: 16; 8 with --moe)")
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE-shaped model, converted TP2 x EP2")
    p.add_argument("--before", default=None, help="another source tree of megatron-npu to measure in the same run")
    p.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args()
    layers = ns.layers or (8 if ns.moe else 16)
    work = ns.work or tempfile.mkdtemp(prefix="convert-memory-")
    if ns.write_only:
        (write_moe_model if ns.moe else write_model)(os.path.join(work, "hf"), layers)
        return
    # The model is written by a child: Linux carries a process's peak RSS across exec into the
    # processes it starts, so a parent that held the random model would mask the converters' peaks.
    kind = ["--moe"] if ns.moe else []
    subprocess.run(
        [sys.executable, __file__, "--work", work, "--layers", str(layers), *kind, "--write-only"], check=True
    )
    with open(os.path.join(work, "hf", "model.safetensors.index.json")) as f:
        size = json.load(f)["metadata"]["total_size"]
    params = size // 2
    shard = largest_shard(os.path.join(work, "hf"))
    print(
        f"model: {params / 1e9:.2f} B parameters, {size / (1 << 30):.2f} GiB bf16 in {work}/hf "
        f"(largest shard {shard / (1 << 30):.2f} GiB)"
    )
    layout = ["--tp", "2", "--ep", "2"] if ns.moe else ["--tp", "2", "--pp", "2"]
    convert = [sys.executable, "-m", "megatron_npu.cli", "convert"]
    trees = {"this tree": None, **({f"before ({ns.before})": ns.before} if ns.before else {})}
    for n, (name, tree) in enumerate(trees.items()):
        out = os.path.join(work, f"megatron-{n}")
        peak, secs = peak_of([*convert, "to-megatron", f"{work}/hf", out, *layout], tree)
        print(f"{name}: to-megatron: peak RSS {peak:.2f} GiB ({ratios(peak, size, shard)}), {secs:.0f} s")
        peak, secs = peak_of([*convert, "to-hf", out, f"{work}/back-{n}"], tree)
        print(f"{name}: to-hf:       peak RSS {peak:.2f} GiB ({ratios(peak, size, shard)}), {secs:.0f} s")


if __name__ == "__main__":
    main()
