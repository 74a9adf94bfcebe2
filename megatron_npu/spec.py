"""The transformer-layer ModuleSpec of pretrain_gpt.py: where a backend plugs in.

megatron-core's local spec (its own attention, MLP and norms; no Transformer
Engine). Its norm is rebound by the patch layer to a sequence-parallel-capable
torch norm (patches/transformer.py), so SP works on every target.
"""

from __future__ import annotations

import argparse

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec


def gpt_layer_spec(args: argparse.Namespace) -> ModuleSpec:
    return get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
