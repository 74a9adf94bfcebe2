"""--split-sentences as Megatron-LM core_v0.16.1's tools/preprocess_data.py splits: NLTK's punkt.

The splitter is built as that tool builds it, through the same ``nltk.load`` URL, so whatever
the installed nltk makes of that URL applies here too (nltk >= 3.9 turns
``nltk:tokenizers/punkt/<lang>.pickle`` into the ``punkt_tab`` model; with ``NLTK_DATA`` set
the tool names a pickle file there, which nltk >= 3.9 refuses to unpickle). --keep-newlines
is the same punkt parameters with a period context that keeps the whitespace after a sentence
end in that sentence. A text is split in chunks of a million characters, as there.

Imported only with --split-sentences: ``import nltk`` costs about a second (it imports scipy).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from megatron_npu.data.tokenizers import TokenizerError

CHUNK = 1_000_000  # characters per punkt call, as in Megatron-LM's tool

Splitter = Callable[[str], list[str]]


def _install_hint(nltk) -> str:
    # nltk >= 3.9 reads the pickle-free punkt_tab model in place of the punkt pickles
    data = "punkt_tab" if hasattr(nltk.tokenize, "PunktTokenizer") else "punkt"
    return f"python -m nltk.downloader {data}"


def _url(lang: str) -> str:
    """The resource Megatron-LM's tool loads for --lang."""
    root = os.environ.get("NLTK_DATA")
    if root:
        return "file:" + os.path.join(root, "tokenizers", "punkt", f"{lang}.pickle")
    return "nltk:" + os.path.join("tokenizers", "punkt", f"{lang}.pickle")


def build_splitter(lang: str, keep_newlines: bool) -> Splitter:
    """The sentence splitter for --lang, or a one-line TokenizerError naming what to install."""
    try:
        import nltk
        from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer
    except ImportError:
        raise TokenizerError(
            "--split-sentences needs NLTK (pip install nltk, then its punkt data: "
            "python -m nltk.downloader punkt_tab); or drop --split-sentences"
        ) from None
    url = _url(lang)
    try:
        punkt = nltk.load(url)
    except LookupError:
        raise TokenizerError(
            f"--split-sentences --lang {lang}: NLTK's punkt data for {lang!r} is not installed "
            f"({_install_hint(nltk)}; nltk looks in {', '.join(nltk.data.path[:3])}, ...)"
        ) from None
    except Exception as e:  # a bad --lang, a refused or missing pickle under NLTK_DATA
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        hint = "; unset NLTK_DATA to use nltk's punkt_tab model" if os.environ.get("NLTK_DATA") else ""
        raise TokenizerError(
            f"--split-sentences --lang {lang}: nltk cannot load {url}: {type(e).__name__}: {first}{hint}"
        ) from None
    if keep_newlines:

        class KeepNewlines(PunktLanguageVars):
            # The default context is "sentence end, then \s+ and the next token" outside the
            # match; taking the \s* into the match keeps "\n" with the sentence before it.
            _period_context_fmt = r"\S* %(SentEndChars)s \s* (?=(?P<after_tok> %(NonWord)s | (?P<next_tok>\S+)))"

        punkt = PunktSentenceTokenizer(train_text=punkt._params, lang_vars=KeepNewlines())
    return lambda text: [s for i in range(0, len(text), CHUNK) for s in punkt.tokenize(text[i : i + CHUNK])]
