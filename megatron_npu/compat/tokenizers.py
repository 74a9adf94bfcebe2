"""megatron-core's own tokenizer builder (``build_tokenizer(args)``), wherever the release keeps it.

- 0.15-0.16: ``megatron.core.tokenizers.text.utils.build_tokenizer``, reading Megatron-LM 0.16's tokenizer
  arguments, the ones this trainer parses (``training/sections/tokenizer.py``'s ``TokenizerSection``).
- 0.17+: ``megatron.core.tokenizers.utils.build_tokenizer``, reading Megatron-LM 0.17's names
  (``special_tokens``, ``metadata_path``, ``tokenizer_hf_no_use_fast``, ...) and, from 0.17, padding the
  vocabulary itself: the 0.16 namespace is given the new names (same meaning) before the call.
- before 0.15: no ``megatron.core.tokenizers``; ``ReleaseGap`` names ``--legacy-tokenizer``.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from megatron_npu.compat.core import find, gap

BUILDER_016 = "megatron.core.tokenizers.text.utils.build_tokenizer"  # 0.15.x, 0.16.x
BUILDER_017 = "megatron.core.tokenizers.utils.build_tokenizer"  # 0.17.x-0.19.x


def core_tokenizer_builder() -> Callable[[argparse.Namespace], Any]:
    """``build_tokenizer(args)`` taking Megatron-LM 0.16's tokenizer arguments, on every release that has one."""
    builder = find(BUILDER_016, "build_tokenizer")
    if callable(builder):
        return builder
    builder = find(BUILDER_017, "build_tokenizer")
    if callable(builder):
        return functools.partial(_with_017_names, builder)
    raise gap(
        "megatron.core.tokenizers (the default tokenizer system)",
        "pass --legacy-tokenizer (Megatron-LM's legacy tokenizers), or install megatron-core >= 0.15",
    )


def names_017(args: argparse.Namespace) -> argparse.Namespace:
    """Megatron-LM 0.16's tokenizer arguments under the names 0.17's builder reads (a copy)."""
    out = argparse.Namespace(**vars(args))
    out.special_tokens = list(args.tokenizer_special_tokens or []) or None
    out.metadata_path = args.tokenizer_metadata
    # 0.16's flags say "use" (default off), 0.17's say "no" (default off): the same choice, inverted
    out.tokenizer_hf_no_use_fast = not args.tokenizer_hf_use_fast
    out.tokenizer_hf_no_include_special_tokens = not args.tokenizer_hf_include_special_tokens
    out.tokenizer_sentencepiece_ignore_extra_whitespaces = True  # Megatron-LM 0.18's default (0.16's behaviour)
    out.chat_template = None
    # the trainer pads the vocabulary itself (--make-vocab-size-divisible-by x TP): 0.18+ skip their padding;
    # 0.17 pads unconditionally into this throwaway copy (multiple 1, no log line)
    out.pad_vocab_size = False
    out.padded_vocab_size = None
    out.make_vocab_size_divisible_by = out.tensor_model_parallel_size = 1
    out.rank = -1
    return out


def _with_017_names(builder: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> Any:
    return builder(names_017(args))
