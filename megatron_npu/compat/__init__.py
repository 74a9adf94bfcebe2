"""megatron-core APIs this project's trainer uses, on every supported release (0.12.x-0.19.x).

Each name is looked up by capability (does the release have it?), never by comparing versions: where a
release lacks an API, an equivalent built from what it has, or, where none exists, ``ReleaseGap`` with one
line naming the release and what to change. One module per kind of API: core.py (functions), configs.py
(config dataclasses), tokenizers.py, parallel_state.py (megatron-core's, with vp_stage on 0.12), specs.py
(spec-building seams; it imports megatron-core, so import it by name). The patch layer (patches/) is separate:
it changes how megatron-core runs; this only lets the project's own pretrain_gpt.py import and call it.
"""

from __future__ import annotations

from .configs import release_config
from .core import (
    ReleaseGap,
    check_checkpoint_support,
    check_mtp_support,
    check_virtual_pipeline_support,
    checkpoint_write_results_queue,
    fully_reshardable_optimizer_formats,
    get_batch_on_this_cp_rank,
    moe_layer_wise_logging_tracker,
    squared_relu,
    standard_megatron_optimizer,
    unwrap_model,
)
from .tokenizers import core_tokenizer_builder

__all__ = [
    "ReleaseGap",
    "check_checkpoint_support",
    "check_mtp_support",
    "checkpoint_write_results_queue",
    "check_virtual_pipeline_support",
    "fully_reshardable_optimizer_formats",
    "core_tokenizer_builder",
    "get_batch_on_this_cp_rank",
    "moe_layer_wise_logging_tracker",
    "release_config",
    "squared_relu",
    "standard_megatron_optimizer",
    "unwrap_model",
]
