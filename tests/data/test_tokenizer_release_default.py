"""On megatron-core 0.12-0.14 (no megatron.core.tokenizers) the tokenizers default to Megatron-LM's legacy ones,
as that release's Megatron-LM does (it has no --legacy-tokenizer to ask for them), said in one line."""

from __future__ import annotations

import pytest

from megatron_npu.data import tokenizers


@pytest.fixture
def release(monkeypatch):
    def use(version: str) -> None:
        monkeypatch.setattr("megatron_npu.version.installed_megatron_core", lambda: version)
        tokenizers._has_core_tokenizers.cache_clear()
        tokenizers._say_legacy_once.cache_clear()

    yield use
    tokenizers._has_core_tokenizers.cache_clear()
    tokenizers._say_legacy_once.cache_clear()


def test_releases_without_core_tokenizers_use_the_legacy_ones_saying_so_once(release, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    release("0.12.1")
    null = tokenizers.TokenizerSection(tokenizer_type="NullTokenizer", vocab_size=100)
    first, second = tokenizers.build(null), tokenizers.build(null)
    assert isinstance(first, tokenizers.LegacyTokenizer) and isinstance(second, tokenizers.LegacyTokenizer)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "megatron-npu: megatron-core 0.12.1 has no megatron.core.tokenizers: Megatron-LM's legacy tokenizers are "
        "used, as that release's Megatron-LM does"
    ]
    release("0.16.1")
    assert not tokenizers.for_this_release(null).legacy_tokenizer  # megatron-core's own, as core_v0.16.1
    assert capsys.readouterr().err == ""
