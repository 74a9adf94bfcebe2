"""Checks of Megatron-LM core_v0.16.1's architecture flags of today's model families (DeepSeek-V3, Qwen3,
LLaMA-3.x, gpt-oss, Mixtral): multi-latent attention and YaRN, multi-token prediction, sliding-window and
sink attention, gpt-oss's activation, NoPE layers. The flags are fields of the model section
(``sections/model.py``); pure Python, as the parser must be (the migration tool imports it).
"""

from __future__ import annotations

import argparse

from ..fates import ConfigError


def tuple_type(value: str) -> tuple[int, ...]:
    """Megatron-LM's ``tuple_type``: ``"128,0"`` or ``"(128,0)"`` -> (128, 0)."""
    try:
        return tuple(int(item) for item in value.strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of integers") from None


def check_model_family_args(args: argparse.Namespace) -> None:
    """Megatron-LM core_v0.16.1's checks of these flags (validate_args and
    core_transformer_config_from_args), before any process group."""
    if args.position_embedding_type == "yarn" and args.multi_latent_attention:
        raise ConfigError(
            "--position-embedding-type yarn is standard attention's YaRN; multi-latent attention takes "
            "--position-embedding-type rope with --rope-type yarn"
        )
    if args.position_embedding_type == "yarn" and args.rotary_interleaved:
        raise ConfigError(
            "--rotary-interleaved with --position-embedding-type yarn: megatron-core's YaRN rotates halves"
        )
    if args.multi_latent_attention and args.group_query_attention:
        raise ConfigError("--multi-latent-attention and --group-query-attention are mutually exclusive; drop one")
    if args.rope_type is not None and not args.multi_latent_attention and args.rope_type != "rope":
        raise ConfigError(f"--rope-type {args.rope_type} needs --multi-latent-attention (other attention: rope)")
    if args.quick_geglu and (args.swiglu or args.squared_relu):
        raise ConfigError("--quick-geglu, --swiglu and --squared-relu are mutually exclusive; pick one")
    if args.mtp_num_layers:
        if args.position_embedding_type not in ("rope", "none"):
            raise ConfigError(
                f"--mtp-num-layers needs --position-embedding-type rope or none, not {args.position_embedding_type}"
            )
    for flag, value in (("--window-attn-skip-freq", args.window_attn_skip_freq), ("--no-rope-freq", args.no_rope_freq)):
        if isinstance(value, list) and len(value) != args.num_layers:
            raise ConfigError(f"{flag} gives {len(value)} layers; --num-layers is {args.num_layers}")
    if args.window_size is not None and len(args.window_size) != 2:
        raise ConfigError(f"--window-size takes two integers (left,right), got {args.window_size}")
