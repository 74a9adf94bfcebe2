"""Which layers are MoE layers, and what one MoE layer moves: pure Python, shared by the layer
spec (megatron_npu/spec.py), the planner and perf-report."""

from __future__ import annotations

import argparse
import ast


def moe_layer_pattern(freq: int | list[int], num_layers: int) -> list[bool]:
    """megatron-core's reading of ``--moe-layer-freq`` (get_gpt_decoder_layer_specs): N is one MoE
    layer every N layers starting with the first; a list gives each layer (1 = MoE)."""
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(num_layers)]
    if len(freq) != num_layers:
        raise ValueError(f"--moe-layer-freq gives {len(freq)} layers; --num-layers is {num_layers}")
    return [bool(x) for x in freq]


def moe_freq_type(value: str) -> int | list[int]:
    """Megatron-LM's ``--moe-layer-freq``: N (one MoE layer every N) or a Python list expression
    such as ``([1]*3+[0]*1)*2`` (1 = MoE layer, 0 = dense), evaluated without ``eval``."""
    if value.strip().lstrip("-").isdigit():
        return int(value)
    try:
        pattern = _eval_pattern(ast.parse(value, mode="eval").body)
    except (SyntaxError, ValueError) as error:
        raise argparse.ArgumentTypeError(f"invalid --moe-layer-freq {value!r}: {error}") from None
    if not isinstance(pattern, list) or any(x not in (0, 1) for x in pattern):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {value!r} must give a list of 0 and 1")
    return pattern


def _eval_pattern(node: ast.AST) -> int | list[int]:
    """Integers, lists, ``+`` and ``*``: what Megatron-LM's patterns use (it calls eval)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_eval_pattern(item) for item in node.elts]  # type: ignore[misc]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_pattern(node.left), _eval_pattern(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right  # type: ignore[operator]
    raise ValueError("only integers, lists, + and * are allowed")
