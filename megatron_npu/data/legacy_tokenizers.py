"""Megatron-LM's legacy tokenizers (``--legacy-tokenizer``), id for id.

megatron-core 0.16 ships only the new tokenizer system (``megatron.core.tokenizers``); the
legacy classes live in Megatron-LM's ``megatron/training/tokenizer/tokenizer.py``, which the
wheel lacks, so they are written here over the same libraries (sentencepiece, transformers,
HF ``tokenizers``). tests/data/test_preprocess_upstream.py compares their output with Megatron-LM's
``tools/preprocess_data.py --legacy-tokenizer`` byte for byte. No torch import.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

from megatron_npu.data.word_cache import WordCachedEncoder


class TokenizerError(ValueError):
    """A missing or wrong tokenizer file/flag; the message names the flag to fix."""


class LegacyTokenizer:
    """What GPTDatasetConfig and preprocessing read: vocab_size, eod, pad, bos, tokenize."""

    def __init__(self) -> None:
        self.unique_identifiers: OrderedDict[str, Any] = OrderedDict(class_name=type(self).__name__)

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


class NullTokenizer(LegacyTokenizer):
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
        return [int(x) for x in text.split(" ")]  # Megatron-LM splits on single spaces

    def detokenize(self, ids: Any) -> str:
        return " ".join(str(int(i)) for i in ids)


class SentencePieceTokenizer(LegacyTokenizer):
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


class HuggingFaceTokenizer(LegacyTokenizer):
    """A local HF tokenizer directory (AutoTokenizer, fast tokenizers preferred)."""

    def __init__(self, path: str, trust_remote_code: bool = False) -> None:
        super().__init__()
        from transformers import AutoTokenizer

        # Megatron-LM: AutoTokenizer's defaults (a fast tokenizer where there is one)
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
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


class GPT2BPETokenizer(LegacyTokenizer):
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
