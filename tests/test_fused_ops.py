"""Fused-op layer: the torch twin of every fused kernel computes what megatron-core computes unfused.

On npu the same functions call torch_npu's kernels (their names and arguments are
checked against the real wheel in test_npu_contract.py); here the torch math runs.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from megatron_npu.ops import fused


@pytest.fixture(scope="module")
def rope_utils():
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils


@pytest.mark.parametrize("rot_dim", [16, 8])
def test_rotary_equals_megatron_unfused_rope(rope_utils, rot_dim):
    generator = torch.Generator().manual_seed(0)
    t = torch.randn(12, 2, 4, 16, generator=generator)  # [seq, batch, heads, head_dim]
    freqs = torch.randn(12, 1, 1, rot_dim, generator=generator)
    expected = rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
    torch.testing.assert_close(fused.rotary(t, freqs), expected, rtol=0, atol=1e-6)


def test_swiglu_is_megatrons_gated_linear_unit_with_silu():
    x = torch.randn(5, 3, 32, generator=torch.Generator().manual_seed(1))
    gate, linear = torch.chunk(x, 2, dim=-1)
    torch.testing.assert_close(fused.swiglu(x), F.silu(gate) * linear, rtol=0, atol=0)


def test_rms_norm_module_matches_torch_rmsnorm_forward_and_backward():
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    ours, reference = fused.RMSNorm(32, eps=1e-5), torch.nn.RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        reference.weight.copy_(ours.weight)
    out_ours, out_ref = ours(x), reference(x)
    torch.testing.assert_close(out_ours, out_ref)
    (grad_ours,) = torch.autograd.grad(out_ours.square().sum(), ours.weight)
    (grad_ref,) = torch.autograd.grad(out_ref.square().sum(), reference.weight)
    torch.testing.assert_close(grad_ours, grad_ref)


def test_npu_patches_keep_the_signatures_of_what_they_replace(rope_utils):
    """The replacements are called by megatron-core with its own argument lists."""
    from megatron.core.fusions import fused_bias_swiglu

    from megatron_npu.registry import REGISTRY

    patches = {p.target: p for p in REGISTRY.patches if p.subsystem == "fused_ops"}
    assert set(patches) == {
        "megatron.core.models.common.embeddings.rope_utils:_apply_rotary_pos_emb_bshd",
        "megatron.core.fusions.fused_bias_swiglu:bias_swiglu_impl",
    }
    assert all(p.requires == "has_fused_kernels" for p in patches.values())

    class WithKernels:  # an accelerator that reports the kernels, to build the replacements
        def fused_ops(self):
            return {"rotary": True, "swiglu": True}

    for target, original in (
        ("megatron.core.models.common.embeddings.rope_utils:_apply_rotary_pos_emb_bshd",
         rope_utils._apply_rotary_pos_emb_bshd),
        ("megatron.core.fusions.fused_bias_swiglu:bias_swiglu_impl", fused_bias_swiglu.bias_swiglu_impl),
    ):  # fmt: skip
        replacement = patches[target].build(original, WithKernels())
        assert replacement is not original
        assert list(inspect.signature(replacement, follow_wrapped=False).parameters) == list(
            inspect.signature(original).parameters
        )


@pytest.fixture(scope="module")
def model_parallel():
    """megatron's modules read their TP size from parallel_state: a 1-rank gloo world here."""
    import torch.distributed as dist
    from distributed import free_port
    from megatron.core import parallel_state, tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_flash_attention_twin_equals_megatron_dot_product_attention_with_gqa(model_parallel):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_npu.ops.attention import FusedDotProductAttention

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                               attention_dropout=0.0, masked_softmax_fusion=False)  # fmt: skip
    attention = FusedDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                         attention_type="self")  # fmt: skip
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(16, 2, 8, 8, generator=generator)  # [sq, b, heads, head_dim]
    key, value = (torch.randn(16, 2, 2, 8, generator=generator) for _ in range(2))  # 2 query groups
    unfused = attention(query, key, value, None)  # no kernel on cpu: megatron-core's own attention
    twin = fused.flash_attention(query, key, value, softmax_scale=attention.softmax_scale)
    assert unfused.shape == twin.shape == (16, 2, 64)
    torch.testing.assert_close(twin, unfused, rtol=1e-5, atol=1e-6)
