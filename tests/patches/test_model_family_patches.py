"""The patches Megatron-LM's own trainer needs for the DeepSeek / Kimi / gpt-oss recipes on the local spec
(megatron_npu/patches/attention.py, embeddings.py, mappings.py), each on the megatron-core object that failed. Found
by Megatron-LM core_v0.16.1's pretrain_gpt.py on its model recipes (tests/upstream/test_upstream_families.py)."""

from __future__ import annotations

import pytest
import torch

import megatron_npu  # noqa: F401  (patches on import)


def test_yarn_rope_builds_on_the_host(model_parallel):
    """YarnRotaryEmbedding opened ``with torch.device(torch.cuda.current_device())``: a bare index, which CPU torch
    cannot resolve ("Cannot access accelerator device when none is available")."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    rope = YarnRotaryEmbedding(kv_channels=8, scaling_factor=40.0, original_max_position_embeddings=64, mscale=0.707)
    freqs, _ = rope(16)
    assert freqs.shape[0] == 16 and torch.isfinite(freqs).all()


def test_local_dot_product_attention_takes_mla_head_sizes(model_parallel):
    """MLASelfAttention builds its core attention with k_channels / v_channels (TypeError on the local class): the
    context width follows the value heads, and the default softmax scale the query/key heads."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, kv_channels=8)
    attention = DotProductAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self", k_channels=12, v_channels=6
    )
    assert attention.hidden_size_per_partition == 12  # 2 heads x 6
    assert attention.softmax_scale == pytest.approx(12**-0.5)
    q = k = torch.randn(4, 1, 2, 12)
    v = torch.randn(4, 1, 2, 6)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).triu(1)
    assert attention(q, k, v, mask).shape == (4, 1, 12)


def test_a_reduce_output_takes_an_in_place_update(model_parallel):
    """MLP.forward adds an expert's bias in place to fc2's output; through _ReduceFromModelParallelRegion (expert TP
    1 without EP) that output was its input object: "Output 0 of _ReduceFromModelParallelRegion is a view and is
    being modified inplace". The gradient is the identity's, and the input's storage is shared (no copy)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    weight = torch.randn(3, requires_grad=True)
    product = weight * 2
    output = reduce_from_tensor_model_parallel_region(product, group=parallel_state.get_tensor_model_parallel_group())
    assert output.data_ptr() == product.data_ptr()
    output += 1.0
    output.sum().backward()
    torch.testing.assert_close(weight.grad, torch.full((3,), 2.0))
