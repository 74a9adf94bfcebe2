"""megatron-core APIs this project's trainer uses, on every supported release (0.12.x-0.19.x).

Each name is looked up by capability (does the release have it?), never by comparing versions: where a
release lacks an API, an equivalent built from what it has, or, where none exists, ``ReleaseGap`` with one
line naming the release and what to change. The patch layer (patches/) is separate: it changes how
megatron-core runs; this only lets the project's own pretrain_gpt.py import and call it.
"""

from __future__ import annotations

from .core import (
    ReleaseGap,
    core_tokenizer_builder,
    moe_layer_wise_logging_tracker,
    squared_relu,
    standard_megatron_optimizer,
    unwrap_model,
)

__all__ = [
    "ReleaseGap",
    "core_tokenizer_builder",
    "moe_layer_wise_logging_tracker",
    "squared_relu",
    "standard_megatron_optimizer",
    "unwrap_model",
]
