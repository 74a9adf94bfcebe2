"""Layers per pipeline (virtual) stage: megatron-core 0.16.1's split rules (megatron_npu/layout/stages.py)."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_npu.layout.model_spec import ModelSpec
from megatron_npu.layout.parallel_dims import ParallelDims
from megatron_npu.layout.stages import chunk_layers, virtual_stage_layers


def dims(pp: int, vpp: int = 1, **uneven: object) -> SimpleNamespace:
    return SimpleNamespace(pp=pp, virtual_stages=vpp, **uneven)


def test_even_split_and_interleaving():
    assert virtual_stage_layers(ParallelDims(8, pp=4), 8) == [2, 2, 2, 2]
    assert chunk_layers(dims(2, 2), 8, 1) == [(2, 2), (6, 2)]  # virtual stages 1 and 3


def test_uneven_first_and_last_stages():
    # DeepSeek-V3's 61 layers on PP 8: 7 + 6 x 8 + 6
    counts = virtual_stage_layers(dims(8, first_stage_layers=7, last_stage_layers=6), 61)
    assert counts == [7, 8, 8, 8, 8, 8, 8, 6] and sum(counts) == 61
    assert virtual_stage_layers(dims(4, first_stage_layers=2), 11) == [2, 3, 3, 3]
    # with virtual stages each stage's layers split evenly over its chunks
    assert chunk_layers(dims(2, 2, first_stage_layers=2, last_stage_layers=6), 8, 0) == [(0, 1), (4, 1)]


def test_embedding_and_loss_counted_in_the_split():
    counts = virtual_stage_layers(dims(4, embedding_in_split=True, loss_in_split=True), 30)
    assert counts == [7, 8, 8, 7]


def test_pipeline_layout_string():
    assert virtual_stage_layers(dims(2, 2, layout="Et|(tt|)*2tmL"), 6) == [1, 2, 2, 1]


def test_mtp_and_mla_change_the_last_stage_only():
    m = ModelSpec(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        micro_batch_size=1,
        global_batch_size=8,
        vocab_size=1000,
        multi_latent_attention=True,
        kv_lora_rank=32,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=16,
        mtp_num_layers=1,
        position_embedding_type="rope",
    )
    from megatron_npu.layout.model_spec import stage_params

    first, last = stage_params(m, 1, 2, True, False, 2), stage_params(m, 1, 2, False, True, 2)
    assert not any(n.startswith("mtp.") for n, _ in first)
    assert [n for n, _ in last if n.startswith("embedding.")] == ["embedding.word_embeddings.weight"]
    assert sum(1 for n, _ in last if n.startswith("mtp.layers.0.")) > 4
