"""megatron-core's HuggingFaceTokenizer ids from the ``tokenizers`` library alone, where they are the same.

megatron-core 0.16.1 builds ``AutoTokenizer.from_pretrained(dir)``; importing transformers
imports torch, about 3 s of a preprocessing run's start-up.
For a directory that transformers loads as its generic ``TokenizersBackend`` (alias
``PreTrainedTokenizerFast``) with nothing in ``tokenizer_config.json`` that acts on the
backend, the object transformers wraps is ``tokenizers.Tokenizer.from_file(tokenizer.json)``,
and megatron-core's ids are plain calls on it:

- megatron-core's ``add_special_tokens`` (sep = eos, cls = bos, ...) is the same
  ``add_special_tokens`` of ``AddedToken(normalized=False, special=True)`` on the backend;
- ``text_to_ids`` is ``encode(text, add_special_tokens=False).tokens`` through
  ``token_to_id`` (the unk id where that gives None), or with
  --tokenizer-hf-include-special-tokens ``encode(text).ids``;
- ``vocab_size`` is ``get_vocab_size(with_added_tokens=True)``, ``eod`` the eos token's id.

``direct_encoder`` returns None, and preprocessing uses transformers, unless transformers is
the major version whose loading this follows (5), and whenever the directory holds anything
transformers would act on while loading (a model-specific tokenizer class,
``auto_map``, ``add_bos_token`` / ``add_eos_token``, a special token not already in
``tokenizer.json``, a ``special_tokens_map.json``, an unknown config key, ...).
tests/data/test_data_tokenizers.py checks the backend against transformers' (``to_str``) and the
ids against megatron-core's; tests/data/test_preprocess_upstream.py the datasets against
Megatron-LM's tool.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from typing import Any

import numpy as np

# The transformers whose loading is followed here (read from its metadata: importing it is the
# cost avoided); another, or none (megatron-core then fails), goes through transformers.
TRANSFORMERS_MAJOR = 5
# The classes transformers 5 builds straight from tokenizer.json (model-specific classes
# such as Qwen2Tokenizer may rebuild the pipeline from the vocabulary instead).
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys that do not change a text's ids when transformers loads the directory.
NEUTRAL_KEYS = {
    *NAMED_SPECIALS,
    "backend",
    "tokenizer_class",
    "added_tokens_decoder",
    "extra_special_tokens",
    "additional_special_tokens",
    "clean_up_tokenization_spaces",
    "model_max_length",
    "model_input_names",
    "padding_side",
    "truncation_side",
    "chat_template",
    "add_prefix_space",  # an attribute only in TokenizersBackend; refused below when true
    "split_special_tokens",  # refused below when true
}
# Files transformers merges into the configuration (special tokens, added tokens).
MERGED_FILES = ("special_tokens_map.json", "added_tokens.json")
_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def direct_encoder(path: str | None, include_special_tokens: bool) -> _TokenizersIds | None:
    """The direct encoder for this tokenizer directory, or None where transformers must load it."""
    if not path or not os.path.isdir(path) or any(os.path.exists(os.path.join(path, f)) for f in MERGED_FILES):
        return None
    try:
        if int(importlib.metadata.version("transformers").split(".")[0]) != TRANSFORMERS_MAJOR:
            return None
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    except Exception:  # transformers then loads it, or reports the problem as megatron-core would
        return None
    if not isinstance(config, dict) or not _loads_unchanged(config, tok):
        return None
    return _TokenizersIds(tok, config, include_special_tokens)


def _loads_unchanged(config: dict[str, Any], tok: Any) -> bool:
    """Whether transformers, loading this tokenizer_config.json, leaves the backend as it is."""
    if config.get("tokenizer_class") not in GENERIC_CLASSES:
        return False
    if set(config) - NEUTRAL_KEYS or config.get("add_prefix_space") or config.get("split_special_tokens"):
        return False
    added = {t.content: t for t in tok.get_added_tokens_decoder().values()}
    # transformers adds every named or extra special token that is not an added token yet
    specials = [_content(config.get(k)) for k in NAMED_SPECIALS]
    for k in ("extra_special_tokens", "additional_special_tokens"):
        extra = config.get(k) or []
        if not isinstance(extra, list):
            return False  # a dict of named extras: transformers' handling is not followed here
        specials += [_content(t) for t in extra]
    if any(s is not None and s not in added for s in specials):
        return False
    # ... and re-adds a declared added token whose properties differ from tokenizer.json's
    for token in (config.get("added_tokens_decoder") or {}).values():
        known = added.get(token.get("content")) if isinstance(token, dict) else None
        if known is None or any(token.get(k, getattr(known, k)) != getattr(known, k) for k in _TOKEN_FIELDS):
            return False
    return True


def _content(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


class _TokenizersIds:
    """``vocab_size``, ``eod``, ``tokenize`` and ``tokenize_batch_arrays`` as megatron-core's
    HuggingFaceTokenizer gives them, on the bare ``tokenizers.Tokenizer``."""

    def __init__(self, tok: Any, config: dict[str, Any], include_special_tokens: bool) -> None:
        from tokenizers import AddedToken

        named = {k: _content(config.get(k)) for k in NAMED_SPECIALS}
        # megatron-core's HuggingFaceTokenizer.__init__ with no token flags: eos and sep stand
        # in for each other, so do bos and cls; each set as AddedToken(normalized=False, special)
        fill = {}
        if named["sep_token"] is None and named["eos_token"]:
            fill["sep_token"] = named["eos_token"]
        elif named["eos_token"] is None and named["sep_token"]:
            fill["eos_token"] = named["sep_token"]
        if named["bos_token"] is None and named["cls_token"]:
            fill["bos_token"] = named["cls_token"]
        if named["cls_token"] is None and named["bos_token"]:
            fill["cls_token"] = named["bos_token"]
        if fill:
            tok.add_special_tokens(
                [AddedToken(t, rstrip=False, lstrip=False, normalized=False, special=True) for t in fill.values()]
            )
        named.update(fill)
        # what transformers' encode call sets: no truncation, no padding, specials kept whole
        tok.no_truncation()
        tok.no_padding()
        tok.encode_special_tokens = bool(config.get("split_special_tokens"))
        self.tok = tok
        self.include_special_tokens = include_special_tokens
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.unk_id = None if named["unk_token"] is None else tok.token_to_id(named["unk_token"])
        self.eod = None if named["eos_token"] is None else self._token_id(named["eos_token"])
        self._round_trips: Any = None

    def _token_id(self, token: str) -> int | None:
        """transformers' ``convert_tokens_to_ids`` of one token."""
        i = self.tok.token_to_id(token)
        return self.unk_id if i is None else i

    def _ids(self, encoding: Any) -> np.ndarray:
        """``convert_tokens_to_ids(encoding.tokens)`` without a Python call per token: an id
        whose token string converts back to it needs no conversion (checked once per id)."""
        if self._round_trips is None:
            to_token, to_id = self.tok.id_to_token, self.tok.token_to_id
            self._round_trips = np.array([to_id(to_token(i) or "") == i for i in range(self.vocab_size)] + [False])
        ids = np.asarray(encoding.ids, dtype=np.int64)
        if self._round_trips[np.clip(ids, -1, self.vocab_size)].all():  # -1 / past the end: False
            return ids
        return np.asarray([self._token_id(t) for t in encoding.tokens], dtype=np.int64)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch_arrays([text])[0].tolist()

    def tokenize_batch_arrays(self, texts: list[str]) -> list[np.ndarray]:
        if not texts:
            return []
        encodings = self.tok.encode_batch(texts, add_special_tokens=self.include_special_tokens)
        if self.include_special_tokens:
            return [np.asarray(e.ids, dtype=np.int64) for e in encodings]
        return [self._ids(e) for e in encodings]
