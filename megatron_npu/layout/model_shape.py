"""One GPT model shape with Megatron-LM's defaults, built from the flags once.

The trainer's validation fills args from it, the planner counts bytes with it, perf-report
rebuilds it from args.json, and the tokenizers pad the vocabulary with ``pad_vocab_size``.
No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_npu.layout.parallel_dims import LayoutError, arg_value


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's validate_args: 4h, or with SwiGLU the parameter count of a 4h MLP
    (two input projections) rounded down to a multiple of 64."""
    if swiglu:
        return int((4 * hidden_size * 2 / 3) / 64) * 64
    return 4 * hidden_size


def pad_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron-LM's _vocab_size_with_padding: round up to divisible_by x TP (each TP rank
    holds an equal, aligned slice of the vocabulary)."""
    multiple = max(1, divisible_by * tp)
    return ((vocab_size + multiple - 1) // multiple) * multiple


@dataclass(frozen=True)
class ModelShape:
    """Resolved sizes: no None left (``vocab_size`` None only when no tokenizer is known)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    swiglu: bool = False
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128

    @classmethod
    def build(
        cls,
        num_layers: int,
        hidden_size: int,
        num_attention_heads: int,
        *,
        ffn_hidden_size: int | None = None,
        kv_channels: int | None = None,
        num_query_groups: int | None = None,
        swiglu: bool = False,
        vocab_size: int | None = None,
        make_vocab_size_divisible_by: int = 128,
    ) -> ModelShape:
        """Apply Megatron-LM's defaults; ``num_query_groups`` None means no grouped-query attention."""
        if kv_channels is None:
            if hidden_size % num_attention_heads != 0:
                raise LayoutError(
                    f"--hidden-size {hidden_size} is not divisible by --num-attention-heads "
                    f"{num_attention_heads}; change one, or set --kv-channels"
                )
            kv_channels = hidden_size // num_attention_heads
        if num_query_groups is None:
            num_query_groups = num_attention_heads
        elif num_query_groups <= 0 or num_attention_heads % num_query_groups != 0:
            raise LayoutError(
                f"--num-attention-heads {num_attention_heads} is not divisible by --num-query-groups {num_query_groups}"
            )
        ffn = ffn_hidden_size if ffn_hidden_size is not None else default_ffn_hidden_size(hidden_size, swiglu)
        return cls(
            num_layers,
            hidden_size,
            num_attention_heads,
            num_query_groups,
            kv_channels,
            ffn,
            swiglu,
            vocab_size,
            make_vocab_size_divisible_by,
        )

    @classmethod
    def from_args(cls, args: Any) -> ModelShape:
        """Megatron-LM's flags as a Namespace or args.json's dict. Without a
        ``group_query_attention`` key (the planner's CLI), a given --num-query-groups means GQA."""
        gqa = arg_value(args, "group_query_attention")
        groups = arg_value(args, "num_query_groups") if gqa is None or gqa else None
        return cls.build(
            int(arg_value(args, "num_layers")),
            int(arg_value(args, "hidden_size")),
            int(arg_value(args, "num_attention_heads")),
            ffn_hidden_size=arg_value(args, "ffn_hidden_size"),
            kv_channels=arg_value(args, "kv_channels"),
            num_query_groups=groups,
            swiglu=bool(arg_value(args, "swiglu", False)),
            vocab_size=arg_value(args, "vocab_size"),
            make_vocab_size_divisible_by=int(arg_value(args, "make_vocab_size_divisible_by", 128)),
        )

    @property
    def fc1_out(self) -> int:
        """linear_fc1's output features: SwiGLU projects to gate and value at once."""
        return self.ffn_hidden_size * (2 if self.swiglu else 1)

    def padded_vocab_size(self, tp: int = 1) -> int:
        if self.vocab_size is None:
            raise LayoutError("the vocabulary size is unknown: give --vocab-size (or a tokenizer)")
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    def check_tensor_parallel(self, tp: int, tp_flag: str = "--tp", names: dict[str, str] | None = None) -> None:
        """TP splits heads, query groups and the MLP's hidden features evenly. ``names``: what
        messages call these fields (default: their Megatron-LM flags; the converter: HF's keys)."""
        name = {f: "--" + f.replace("_", "-") for f in ("num_attention_heads", "num_query_groups", "ffn_hidden_size")}
        name |= names or {}
        if self.num_attention_heads % tp != 0:
            raise LayoutError(
                f"{name['num_attention_heads']} {self.num_attention_heads} is not divisible by {tp_flag} {tp}"
            )
        if self.num_query_groups % tp != 0:
            raise LayoutError(
                f"{name['num_query_groups']} {self.num_query_groups} is not divisible by {tp_flag} {tp}; "
                "use a TP size that divides the query groups"
            )
        if self.ffn_hidden_size % tp != 0:
            raise LayoutError(f"{name['ffn_hidden_size']} {self.ffn_hidden_size} is not divisible by {tp_flag} {tp}")
