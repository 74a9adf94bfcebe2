"""One tokenizer module for preprocessing and training (Megatron-LM ``--tokenizer-type``).

megatron-core 0.16 ships tokenizer backends (``megatron.core.tokenizers``), but their
constructors differ from Megatron-LM's ``--tokenizer-type`` semantics (BOS/EOS/pad ids of
GPTSentencePiece/Llama2, padded vocab). The classes here are thin, duck-typed wrappers over
the fast libraries (sentencepiece C++, HF tokenizers Rust) that satisfy GPTDatasetConfig's
contract: vocab_size, eod, pad, unique_identifiers, tokenize, detokenize.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any

from megatron_npu.data.word_cache import WordCachedEncoder
from megatron_npu.layout.model_shape import pad_vocab_size  # the one padding rule (planner, report, here)
from megatron_npu.policy import TOKENIZER_TYPES


class TokenizerError(ValueError):
    """A missing or wrong tokenizer file/flag; the message names the flag to fix."""


class _Base:
    name = "base"

    def __init__(self) -> None:
        self.unique_identifiers: OrderedDict[str, Any] = OrderedDict(class_name=type(self).__name__)
        self._divisible_by = 128
        self._tp = 1

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def tokenize_batch_arrays(self, texts: list[str]) -> list[Any]:
        """tokenize_batch as integer numpy arrays (preprocessing's form)."""
        import numpy as np

        return [np.asarray(ids, dtype=np.int64) for ids in self.tokenize_batch(texts)]

    def detokenize(self, ids: Any) -> str:
        raise NotImplementedError

    @property
    def eos(self) -> int:
        return self.eod

    def padded_vocab_size(self, divisible_by: int | None = None, tp: int | None = None) -> int:
        return pad_vocab_size(
            self.vocab_size,
            self._divisible_by if divisible_by is None else divisible_by,
            self._tp if tp is None else tp,
        )


class NullTokenizer(_Base):
    """Megatron-LM's _NullTokenizer: text is space-separated ids; eod = vocab_size - 1 + 1."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self._vocab = int(vocab_size)
        self.eod = self._vocab  # Megatron-LM: vocab_size + 1 ids, eod is the last
        self.pad = -1
        self.bos = None
        self.unique_identifiers["vocab_size"] = self._vocab

    @property
    def vocab_size(self) -> int:
        return self._vocab + 1

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: Any) -> str:
        return " ".join(str(int(i)) for i in ids)


class SentencePieceTokenizer(_Base):
    """Megatron-LM's _SentencePieceTokenizer: adds <CLS>,<SEP>,<EOD>,<MASK>,<PAD> specials."""

    def __init__(self, model_file: str, vocab_extra_ids: int = 0) -> None:
        super().__init__()
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.unique_identifiers["model"] = os.path.abspath(model_file)
        self._init_specials(vocab_extra_ids)
        self._word_cache: WordCachedEncoder | None = None

    @property
    def _encode_batch(self) -> WordCachedEncoder:
        """Batches go through the word cache, built on first use (its probes read the whole
        vocabulary; training never batches). It encodes with num_threads=1: parallelism comes
        from --workers processes (sentencepiece would otherwise use every core per worker,
        oversubscribing the host and making --workers meaningless)."""
        if self._word_cache is None:
            self._word_cache = WordCachedEncoder(self.sp)
        return self._word_cache

    def _init_specials(self, vocab_extra_ids: int) -> None:
        sp = self.sp
        self._vocab: dict[str, int] = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
        self._inv: dict[int, str] = {i: p for p, i in self._vocab.items()}
        self._special: dict[str, int] = {}

        def add(t: str) -> int:
            if t not in self._vocab:
                i = len(self._vocab)
                self._vocab[t] = i
                self._inv[i] = t
            self._special[t] = self._vocab[t]
            return self._vocab[t]

        self.cls = add("<CLS>")
        self.sep = add("<SEP>")
        self.eod = add("<EOD>")
        self.mask = add("<MASK>")
        self.pad = add(sp.id_to_piece(sp.pad_id()) if sp.pad_id() >= 0 else "<PAD>")
        self.bos = add(sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else "<BOS>")
        self.eos_id = add(sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else "<EOS>")
        for i in range(vocab_extra_ids):
            add(f"<extra_id_{i}>")

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eos(self) -> int:
        return self.eos_id  # Megatron-LM: the model's own </s>, distinct from the added <EOD>

    def tokenize(self, text: str) -> list[int]:
        # Megatron-LM: a special token's literal text ("<EOD>", "</s>", ...) becomes its id;
        # the text between is encoded by SentencePiece. Earliest match first; on a tie the
        # first-added special wins.
        ids: list[int] = []
        idx = 0
        while True:
            best, pos = None, -1
            for t in self._special:
                j = text.find(t, idx)
                if j >= 0 and (pos < 0 or j < pos):
                    best, pos = t, j
            if best is None:
                break
            ids.extend(self.sp.encode(text[idx:pos]))
            ids.append(self._special[best])
            idx = pos + len(best)
        ids.extend(self.sp.encode(text[idx:]))
        return ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        # The texts with no special-token literal go through the word cache together.
        plain = [i for i, t in enumerate(texts) if not any(s in t for s in self._special)]
        out: list[list[int]] = [[] for _ in texts]
        if plain:
            encoded = self._encode_batch([texts[i] for i in plain])
            for i, ids in zip(plain, encoded, strict=True):
                out[i] = ids
        if len(plain) < len(texts):
            done = set(plain)
            for i, t in enumerate(texts):
                if i not in done:
                    out[i] = self.tokenize(t)
        return out

    def detokenize(self, ids: Any) -> str:
        # Megatron-LM's format: each special token is written as " <TOKEN> ".
        ids = [int(i) for i in ids]
        inv_special = {i: t for t, i in self._special.items()}
        text, last = "", 0
        for k, i in enumerate(ids):
            if i in inv_special:
                text += self.sp.decode(ids[last:k]) + " " + inv_special[i] + " "
                last = k + 1
        return text + self.sp.decode(ids[last:])


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron-LM's _GPTSentencePieceTokenizer: the model's own ids, eod = eos_id, pad = pad_id."""

    def _init_specials(self, vocab_extra_ids: int) -> None:
        sp = self.sp
        self.pad = sp.pad_id()
        self.bos = sp.bos_id()
        self.eod = self.eos_id = sp.eos_id()
        self.cls = self.sep = self.mask = -1

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encode_batch(texts)

    def tokenize_batch_arrays(self, texts: list[str]) -> list[Any]:
        return self._encode_batch.arrays(texts)

    def detokenize(self, ids: Any) -> str:
        return self.sp.decode([int(i) for i in ids])


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron-LM's _Llama2Tokenizer: tokenize(text, bos=True, eos=False)."""

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = self.sp.encode(text)
        return ([self.bos] if bos else []) + ids + ([self.eod] if eos else [])

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [[self.bos, *ids] for ids in self._encode_batch(texts)]

    def tokenize_batch_arrays(self, texts: list[str]) -> list[Any]:
        import numpy as np

        arrays = self._encode_batch.arrays(texts)
        bos = np.array([self.bos], dtype=self._encode_batch.dtype)
        return [np.concatenate((bos, a)) for a in arrays]


class HuggingFaceTokenizer(_Base):
    """A local HF tokenizer directory (AutoTokenizer, fast tokenizers preferred)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True, use_fast=True)
        self.unique_identifiers["model"] = os.path.abspath(path)
        self.eod = self.tok.eos_token_id if self.tok.eos_token_id is not None else -1
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eod
        self.bos = self.tok.bos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    # Megatron-LM's _HuggingFaceTokenizer calls the tokenizer with its defaults, i.e. with the
    # post-processor's special tokens (a Llama-3 tokenizer prepends <|begin_of_text|>), and its
    # preprocess_data.py stores exactly that: do the same so datasets match.
    def tokenize(self, text: str) -> list[int]:
        return self.tok(text)["input_ids"]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts)["input_ids"]

    def detokenize(self, ids: Any) -> str:
        return self.tok.decode([int(i) for i in ids])


class GPT2BPETokenizer(_Base):
    """GPT-2 byte-level BPE from vocab.json + merges.txt, via HF `tokenizers` (Rust)."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        super().__init__()
        from tokenizers import ByteLevelBPETokenizer

        self.tok = ByteLevelBPETokenizer(vocab_file, merge_file)
        self.unique_identifiers["vocab"] = os.path.abspath(vocab_file)
        self.unique_identifiers["merges"] = os.path.abspath(merge_file)
        self.eod = self.tok.token_to_id("<|endoftext|>")
        if self.eod is None:
            raise TokenizerError(f"--vocab-file {vocab_file}: no <|endoftext|> token")
        self.pad = self.eod
        self.bos = None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def tokenize(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def detokenize(self, ids: Any) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _need_file(path: str | None, flag: str, kind: str) -> str:
    if not path:
        raise TokenizerError(f"{kind} needs {flag}")
    if not os.path.exists(path):
        raise TokenizerError(f"{flag} {path}: no such file")
    return path


def build_tokenizer(
    tokenizer_type: str,
    *,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_size: int | None = None,
    make_vocab_size_divisible_by: int = 128,
    tensor_model_parallel_size: int = 1,
) -> _Base:
    """Build a tokenizer as Megatron-LM's --tokenizer-type does; TokenizerError on bad flags."""
    t = tokenizer_type
    if t == "NullTokenizer":
        if vocab_size is None:
            raise TokenizerError("NullTokenizer needs --vocab-size")
        tok: _Base = NullTokenizer(vocab_size)
    elif t in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        path = _need_file(tokenizer_model, "--tokenizer-model", t)
        cls = {
            "SentencePieceTokenizer": SentencePieceTokenizer,
            "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
            "Llama2Tokenizer": Llama2Tokenizer,
        }[t]
        try:
            tok = cls(path)
        except TokenizerError:
            raise
        except Exception as e:  # sentencepiece raises OSError/RuntimeError on a non-model file
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TokenizerError(f"--tokenizer-model {path}: not a SentencePiece model ({msg})") from None
    elif t == "HuggingFaceTokenizer":
        path = _need_file(tokenizer_model, "--tokenizer-model", t)
        try:
            tok = HuggingFaceTokenizer(path)
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TokenizerError(f"--tokenizer-model {path}: not a local HuggingFace tokenizer ({msg})") from None
    elif t == "GPT2BPETokenizer":
        v = _need_file(vocab_file, "--vocab-file", t)
        m = _need_file(merge_file, "--merge-file", t)
        try:
            with open(v, encoding="utf-8") as f:
                json.load(f)
            tok = GPT2BPETokenizer(v, m)
        except TokenizerError:
            raise
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TokenizerError(f"--vocab-file/--merge-file: not GPT-2 BPE files ({msg})") from None
    else:
        raise TokenizerError(f"--tokenizer-type {t!r}: choose one of {', '.join(TOKENIZER_TYPES)}")
    tok._divisible_by = make_vocab_size_divisible_by
    tok._tp = tensor_model_parallel_size
    return tok
