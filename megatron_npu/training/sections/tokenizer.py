"""The tokenizer section: which tokenizer, its files and options, and the vocabulary size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import Section

# The --tokenizer-type values megatron_npu.data.tokenizers.build_tokenizer implements: those
# megatron-core 0.16.1's tokenizer builder makes, as Megatron-LM core_v0.16.1 (the Bert ones fetch
# their vocabulary from the hub, TikTokenizer needs tiktoken). Megatron-LM's Multimodal, SFT and
# NullMultimodal types are for its multimodal / SFT scripts, not GPT pretraining.
TOKENIZER_TYPES: tuple[str, ...] = (
    "NullTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "TikTokenizer",
)

TokenizerType = Literal[TOKENIZER_TYPES]  # type: ignore[valid-type]


@dataclass(frozen=True, kw_only=True)
class TokenizerSection(Section):
    """The tokenizer and the vocabulary (Megatron-LM's tokenizer group, shared with preprocessing)."""

    vocab_size: int | None = None
    """Size of vocab before EOD or padding."""

    padded_vocab_size: int | None = None
    """The model's vocabulary (default: padded)."""

    vocab_file: str | None = None
    """Path to the vocab file."""

    merge_file: str | None = None
    """Path to the BPE merge file."""

    vocab_extra_ids: int = 0
    """Number of additional vocabulary tokens."""

    tokenizer_type: TokenizerType | None = None
    """What type of tokenizer to use."""

    tokenizer_model: str | None = None
    """SentencePiece model file, or a local HuggingFace tokenizer directory."""

    tokenizer_metadata: str | None = None
    """Tokenizer metadata JSON (megatron-core)."""

    tokenizer_special_tokens: tuple[str, ...] | None = None
    """Special tokens (megatron-core's)."""

    legacy_tokenizer: bool = False
    """Megatron-LM's legacy tokenizers (default: megatron-core's)."""

    tiktoken_pattern: str | None = None
    """TikTokenizer: the pattern (v1 or v2)."""

    tiktoken_num_special_tokens: int = 1000
    """TikTokenizer: number of special tokens."""

    tiktoken_special_tokens: tuple[str, ...] | None = None
    """TikTokenizer: the special tokens."""

    tokenizer_sentencepiece_legacy: bool = False
    """SentencePiece: legacy special-token handling."""

    tokenizer_hf_use_fast: bool = False
    """HuggingFace: the fast tokenizer."""

    tokenizer_hf_include_special_tokens: bool = False
    """HuggingFace: encode special tokens."""

    trust_remote_code: bool = False
    """HuggingFace: allow the model's own code."""
