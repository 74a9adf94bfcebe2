"""One tokenizer module for preprocessing and training, with Megatron-LM core_v0.16.1's semantics.

Megatron-LM 0.16.1 builds the tokenizer its data is written and read with from megatron-core's
own ``megatron.core.tokenizers`` (``build_tokenizer(args)`` in
``megatron/core/tokenizers/text/utils/build_tokenizer.py``); ``--legacy-tokenizer`` selects
the old classes of ``megatron/training/tokenizer`` instead. The two differ in ids: the
SentencePiece types' eod is the model's eos id in the new system and an ``<EOD>`` appended
after the vocabulary in the legacy ``SentencePieceTokenizer``; the new HuggingFace tokenizer
adds no post-processor specials (no BOS) unless ``--tokenizer-hf-include-special-tokens``, and
the new SentencePiece types all encode alike (no Llama-2 BOS).

- ``build_tokenizer``: the new system calls megatron-core's own builder (same object, same
  ids as Megatron-LM); the legacy one uses ``legacy_tokenizers`` (megatron-core lacks them).
- ``preprocessing_encoder``: what preprocessing encodes with. Where the new system's ids are
  library calls (SentencePiece ``encode_as_ids``, the null tokenizer, a HuggingFace tokenizer
  without extra token flags) it makes those calls directly, batched, without importing
  megatron-core (torch and megatron.core's package: 5-8 s of start-up per run); a
  HuggingFace directory that transformers would load unchanged from its tokenizer.json is
  encoded by the ``tokenizers`` library alone (``hf_fast``: no transformers, so no torch);
  everything else goes through ``build_tokenizer``. tests/data/test_data_tokenizers.py checks them against
  megatron-core's tokenizers, tests/data/test_preprocess_upstream.py against Megatron-LM's tool.
- ``padded_vocab_size``: the model's vocabulary as Megatron-LM computes it: from the legacy
  tokenizer's size, which its ``megatron/training/global_vars.py`` always builds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from typing import Any

from megatron_npu.data.legacy_tokenizers import (
    GPT2BPETokenizer,
    GPTSentencePieceTokenizer,
    HuggingFaceTokenizer,
    LegacyTokenizer,
    Llama2Tokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
)
from megatron_npu.layout.model_shape import pad_vocab_size  # the one padding rule (planner, report, here)

# Megatron-LM's tokenizer flags are defined once, as the trainer's section; preprocessing's parser takes its
# argument group. sections/ imports nothing from data/ (no circle); policy.py imports them too.
from megatron_npu.training.sections.tokenizer import TOKENIZER_TYPES, TokenizerSection

__all__ = [
    "TOKENIZER_TYPES",
    "TokenizerError",
    "TokenizerSection",
    "build_tokenizer",
    "pad_vocab_size",
    "padded_vocab_size",
    "preprocessing_encoder",
    "training_tokenizer",
]

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
_LEGACY_CLASSES: dict[str, type[LegacyTokenizer]] = {
    "SentencePieceTokenizer": SentencePieceTokenizer,
    "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
    "Llama2Tokenizer": Llama2Tokenizer,
}


def _with_special_tokens_alias(o: TokenizerSection) -> TokenizerSection:
    """``--tiktoken-special-tokens``, Megatron-LM's deprecated spelling of ``--tokenizer-special-tokens``,
    used when the other is not given (core_v0.16.1's validate_args: its builders read only the new one)."""
    if o.tiktoken_special_tokens and not o.tokenizer_special_tokens:
        return o.replace(tokenizer_special_tokens=o.tiktoken_special_tokens)
    return o


def build_tokenizer(tokenizer_type: str, **options: Any) -> Any:
    """The tokenizer Megatron-LM 0.16.1 builds for these flags; TokenizerError on bad flags.

    ``options`` are ``TokenizerSection`` fields (``legacy_tokenizer=True`` for the legacy one).
    """
    return build(TokenizerSection(tokenizer_type=tokenizer_type, **options))


#: megatron-core's own tokenizers (megatron.core.tokenizers) are new in this release
CORE_TOKENIZERS_SINCE = "0.15"


def for_this_release(o: TokenizerSection) -> TokenizerSection:
    """On a megatron-core without ``megatron.core.tokenizers`` (0.12-0.14) the legacy tokenizers, as that
    release's Megatron-LM uses (it has no --legacy-tokenizer flag to ask for them), said once per process."""
    if o.legacy_tokenizer or o.tokenizer_type not in _LEGACY_TYPES or _has_core_tokenizers():
        return o
    _say_legacy_once()
    return o.replace(legacy_tokenizer=True)


@functools.lru_cache(maxsize=1)
def _has_core_tokenizers() -> bool:
    from packaging.version import Version

    from megatron_npu.version import installed_megatron_core, release_line

    found = installed_megatron_core()  # read from the package metadata: preprocessing imports no megatron-core
    return found is None or Version(release_line(found)) >= Version(CORE_TOKENIZERS_SINCE)


@functools.lru_cache(maxsize=1)
def _say_legacy_once() -> None:
    from megatron_npu.version import installed_megatron_core

    if os.environ.get("RANK", "0") == "0":
        print(
            f"megatron-npu: megatron-core {installed_megatron_core()} has no megatron.core.tokenizers: Megatron-LM's "
            "legacy tokenizers are used, as that release's Megatron-LM does",
            file=sys.stderr,
            flush=True,
        )


def _as_read(o: TokenizerSection) -> TokenizerSection:
    """The section as this release's Megatron-LM reads it (the alias, the release's tokenizer system)."""
    return for_this_release(_with_special_tokens_alias(o))


def build(o: TokenizerSection) -> Any:
    o = _as_read(o)
    _check_files(o)
    return _build_legacy(o) if o.legacy_tokenizer else _build_core(o)


def padded_vocab_size(o: TokenizerSection, tokenizer: Any, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron-LM pads the vocabulary of its global tokenizer, which is always the legacy one
    (megatron/training/global_vars.py); a type with no legacy class here pads its own size."""
    o = _as_read(o)
    if o.legacy_tokenizer or o.tokenizer_type not in _LEGACY_TYPES:
        size = tokenizer.vocab_size
    else:
        size = _build_legacy(o).vocab_size
    return pad_vocab_size(size, divisible_by, tensor_parallel)


def preprocessing_encoder(o: TokenizerSection) -> Any:
    """What preprocessing encodes with: ``vocab_size``, ``eod`` and
    ``tokenize_batch_arrays(texts)``, the ids ``build(o).tokenize`` gives each text."""
    o = _as_read(o)
    if o.legacy_tokenizer:
        return build(o)
    _check_files(o)
    if o.tokenizer_type == "NullTokenizer":
        # megatron-core's null library: the same ids as Megatron-LM's legacy one
        return NullTokenizer(_need_vocab_size(o))
    if o.tokenizer_type in SENTENCEPIECE_TYPES and not (
        o.tokenizer_metadata or o.tokenizer_special_tokens or o.tokenizer_sentencepiece_legacy
    ):
        # megatron-core's SentencePieceTokenizer with these flags is sp.encode_as_ids(text), eod = eos_id
        return _SentencePieceIds(o.tokenizer_model)
    if o.tokenizer_type == "HuggingFaceTokenizer" and not (
        o.tokenizer_metadata or o.tokenizer_special_tokens or o.vocab_file or o.merge_file
    ):
        from megatron_npu.data.hf_fast import direct_encoder

        # the tokenizers library alone where its ids are megatron-core's (no transformers: no torch)
        direct = direct_encoder(o.tokenizer_model, o.tokenizer_hf_include_special_tokens)
        return direct if direct is not None else _HuggingFaceIds(o)
    return _CoreEncoder(build(o))


class _SentencePieceIds:
    """megatron-core's non-legacy SentencePieceTokenizer ids, through the word cache."""

    def __init__(self, model: str) -> None:
        from megatron_npu.data.word_cache import WordCachedEncoder

        try:
            import sentencepiece

            self.sp = sentencepiece.SentencePieceProcessor(model_file=model)
        except Exception as e:  # sentencepiece raises OSError/RuntimeError on a non-model file
            raise TokenizerError(f"--tokenizer-model {model}: not a SentencePiece model ({_first_line(e)})") from None
        self.vocab_size = self.sp.get_piece_size()
        self.eod = self.sp.eos_id()
        self._cache = WordCachedEncoder(self.sp)

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode_as_ids(text)

    def tokenize_batch_arrays(self, texts: list[str]) -> list[Any]:
        return self._cache.arrays(texts)


class _HuggingFaceIds:
    """megatron-core's HuggingFaceTokenizer ids (``text_to_ids``), a batch per call.

    Built as megatron-core builds it (AutoTokenizer, then the same ``add_special_tokens``);
    each text's ids are ``convert_tokens_to_ids`` of its tokens without specials, or the
    call's ``input_ids`` with --tokenizer-hf-include-special-tokens, as there.
    """

    def __init__(self, o: TokenizerSection) -> None:
        try:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(
                o.tokenizer_model, use_fast=o.tokenizer_hf_use_fast, trust_remote_code=o.trust_remote_code
            )
        except Exception as e:
            raise TokenizerError(
                f"--tokenizer-model {o.tokenizer_model}: not a local HuggingFace tokenizer ({_first_line(e)})"
            ) from None
        self.tok.add_special_tokens(_hf_special_tokens(self.tok))
        self.include_special_tokens = o.tokenizer_hf_include_special_tokens
        eos = self.tok.eos_token
        self.eod = None if eos is None else self.tok.convert_tokens_to_ids([eos])[0]
        self.vocab_size = len(self.tok)
        self._round_trips: Any = None

    def _ids(self, encoding: Any) -> Any:
        """``convert_tokens_to_ids(encoding.tokens)`` without a Python call per token: an id
        whose token string converts back to it needs no conversion (checked once per id)."""
        import numpy as np

        if self._round_trips is None:
            tokens = self.tok.convert_ids_to_tokens(list(range(self.vocab_size)))
            back = [None if t is None else self.tok.convert_tokens_to_ids(t) for t in tokens]
            self._round_trips = np.array([b == i for i, b in enumerate(back)] + [False])
        ids = np.asarray(encoding.ids, dtype=np.int64)
        if self._round_trips[np.clip(ids, -1, self.vocab_size)].all():  # -1 / past the end: False
            return ids
        return np.asarray(self.tok.convert_tokens_to_ids(encoding.tokens), dtype=np.int64)

    def tokenize(self, text: str) -> list[int]:
        if self.include_special_tokens:
            return self.tok(text).input_ids
        return self.tok.convert_tokens_to_ids(self.tok.tokenize(text))

    def tokenize_batch_arrays(self, texts: list[str]) -> list[Any]:
        import numpy as np

        if not texts:
            return []
        if self.include_special_tokens:
            ids = self.tok(texts).input_ids
        elif self.tok.is_fast:
            return [self._ids(e) for e in self.tok(texts, add_special_tokens=False).encodings]
        else:
            ids = [self.tokenize(t) for t in texts]
        return [np.asarray(x, dtype=np.int64) for x in ids]


def _hf_special_tokens(tok: Any) -> dict[str, Any]:
    """What megatron-core's HuggingFaceTokenizer.__init__ adds with no token flags: eos and sep
    stand in for each other, so do bos and cls; no additional special tokens."""
    added: dict[str, Any] = {}
    if tok.sep_token is None and tok.eos_token:
        added["sep_token"] = tok.eos_token
    elif tok.eos_token is None and tok.sep_token:
        added["eos_token"] = tok.sep_token
    if tok.bos_token is None and tok.cls_token:
        added["bos_token"] = tok.cls_token
    if tok.cls_token is None and tok.bos_token:
        added["cls_token"] = tok.bos_token
    added["additional_special_tokens"] = []
    return added


class _CoreEncoder:
    """A megatron-core tokenizer, one ``tokenize`` per text (as Megatron-LM's tool calls it)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eod

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.tokenize(text)

    def tokenize_batch_arrays(self, texts: list[str]) -> list[Any]:
        import numpy as np

        return [np.asarray(self.tokenizer.tokenize(t), dtype=np.int64) for t in texts]


_LEGACY_TYPES = (*SENTENCEPIECE_TYPES, "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")


def _build_legacy(o: TokenizerSection) -> LegacyTokenizer:
    t = o.tokenizer_type
    if t == "NullTokenizer":
        return NullTokenizer(_need_vocab_size(o))
    if t in SENTENCEPIECE_TYPES:
        try:
            if t == "SentencePieceTokenizer":
                return SentencePieceTokenizer(o.tokenizer_model, vocab_extra_ids=o.vocab_extra_ids)
            return _LEGACY_CLASSES[t](o.tokenizer_model)
        except Exception as e:
            raise TokenizerError(
                f"--tokenizer-model {o.tokenizer_model}: not a SentencePiece model ({_first_line(e)})"
            ) from None
    if t == "HuggingFaceTokenizer":
        try:
            return HuggingFaceTokenizer(o.tokenizer_model, trust_remote_code=o.trust_remote_code)
        except Exception as e:
            raise TokenizerError(
                f"--tokenizer-model {o.tokenizer_model}: not a local HuggingFace tokenizer ({_first_line(e)})"
            ) from None
    if t == "GPT2BPETokenizer":
        try:
            return GPT2BPETokenizer(o.vocab_file, o.merge_file)
        except TokenizerError:
            raise
        except Exception as e:
            raise TokenizerError(f"--vocab-file/--merge-file: not GPT-2 BPE files ({_first_line(e)})") from None
    raise TokenizerError(
        f"--legacy-tokenizer with --tokenizer-type {t}: megatron-npu has no legacy {t} (Megatron-LM keeps "
        "it in megatron/training/tokenizer, which megatron-core does not ship); drop --legacy-tokenizer"
    )


def _build_core(o: TokenizerSection) -> Any:
    """megatron-core's builder, called as Megatron-LM's tools and pretrain_gpt.py call it."""
    if o.tokenizer_type == "NullTokenizer":
        _need_vocab_size(o)
    from megatron_npu.compat import ReleaseGap, core_tokenizer_builder

    try:  # megatron.core.tokenizers is new in 0.15 and its builder moved in 0.19
        core_build = core_tokenizer_builder()
    except ReleaseGap as e:
        raise TokenizerError(str(e)) from None

    args = argparse.Namespace(**dataclasses.asdict(o))
    if o.tokenizer_special_tokens is not None:
        args.tokenizer_special_tokens = list(o.tokenizer_special_tokens)
    try:
        return core_build(args)
    except Exception as e:
        t = o.tokenizer_type
        files = f"--vocab-file {o.vocab_file} --merge-file {o.merge_file}" if o.vocab_file else ""
        files = f"--tokenizer-model {o.tokenizer_model}" if o.tokenizer_model else files
        # megatron-core 0.16.1's GPT-2 BPE loads "gpt2" from the HuggingFace hub (its vocabulary from
        # --vocab-file, its merges from the hub's gpt2: --merge-file is never read)
        hint = "; offline, --legacy-tokenizer builds it from the local files" if t == "GPT2BPETokenizer" else ""
        raise TokenizerError(
            f"{files} --tokenizer-type {t}: megatron-core's tokenizer could not be built "
            f"({type(e).__name__}: {_first_line(e)}){hint}".lstrip()
        ) from None


def _check_files(o: TokenizerSection) -> None:
    t = o.tokenizer_type
    if t not in TOKENIZER_TYPES:
        raise TokenizerError(f"--tokenizer-type {t!r}: choose one of {', '.join(TOKENIZER_TYPES)}")
    if t in (*SENTENCEPIECE_TYPES, "HuggingFaceTokenizer", "TikTokenizer"):
        _need_file(o.tokenizer_model, "--tokenizer-model", t)
    elif t == "GPT2BPETokenizer":
        _need_file(o.vocab_file, "--vocab-file", t)
        _need_file(o.merge_file, "--merge-file", t)
    if o.tokenizer_metadata and not o.legacy_tokenizer:
        _need_file(o.tokenizer_metadata, "--tokenizer-metadata", t)


def _need_file(path: str | None, flag: str, kind: str) -> str:
    if not path:
        raise TokenizerError(f"{kind} needs {flag}")
    if not os.path.exists(path):
        raise TokenizerError(f"{flag} {path}: no such file")
    return path


def _need_vocab_size(o: TokenizerSection) -> int:
    if o.vocab_size is None:
        raise TokenizerError("NullTokenizer needs --vocab-size")
    return o.vocab_size


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def training_tokenizer(o: TokenizerSection, divisible_by: int, tensor_parallel: int) -> tuple[Any, int]:
    """pretrain_gpt.py's tokenizer (the one its datasets use, as Megatron-LM's
    core_gpt_dataset_config_from_args builds it) and the model's vocabulary size
    (``--padded-vocab-size`` when given, else Megatron-LM's padding to ``--make-vocab-size-divisible-by``
    x the tensor-parallel size)."""
    tokenizer = build(o)
    padded = o.padded_vocab_size
    if padded is None:
        padded = padded_vocab_size(o, tokenizer, divisible_by, tensor_parallel)
    return tokenizer, padded
