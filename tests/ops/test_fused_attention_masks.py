"""The fused attention path (``--use-flash-attn``) through the accelerator's kernel seam, on the cpu target.

The npu target's ``_fused_flash_attention`` runs here over the reference ``npu_fusion_attention``
(tests/accelerator/npu_reference.py, written from CANN's documentation: ``atten_mask`` True = masked,
sparse_mode 0 the full mask within the ``pre_tockens`` / ``next_tockens`` band, sparse_mode 4 the band over the
compressed 2048 x 2048 mask; it refuses argument combinations the documentation calls wrong), and its output is compared with megatron-core's own
unfused DotProductAttention for: a document mask (``--reset-attention-mask``; before the fix the fused path
dropped the mask and attended across documents), sliding-window layers, MLA's different q/k and v head
sizes; attention sinks fall back to megatron-core's math (the kernel has no input for them).
"""

from __future__ import annotations

import pytest
import torch
from accelerator import npu_reference

from megatron_npu.accelerator import set_accelerator
from megatron_npu.accelerator.cpu import CpuAccelerator
from megatron_npu.accelerator.npu import NpuAccelerator


class EmulatedTorchNpu:
    """``npu_fusion_attention`` from the reference operators (tests/accelerator/npu_reference.py, written from
    CANN's documentation), each call's sparse mode and band recorded."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def npu_fusion_attention(self, *args, **kwargs):
        self.calls.append(
            {
                "sparse_mode": kwargs.get("sparse_mode", 0),
                "pre": kwargs.get("pre_tockens", npu_reference.ALL_TOKENS),
                "next": kwargs.get("next_tockens", npu_reference.ALL_TOKENS),
            }
        )
        return npu_reference.npu_fusion_attention(*args, **kwargs)


class EmulatedNpuAttention(CpuAccelerator):
    """The cpu target with the npu target's fused attention over the emulated operator."""

    def __init__(self) -> None:
        super().__init__()
        self.npu = object.__new__(NpuAccelerator)
        self.npu._torch_npu = EmulatedTorchNpu()

    def fused_kernel(self, key):
        return self.npu.fused_kernel(key) if key == "flash_attention" else None


@pytest.fixture
def npu_attention(model_parallel):
    accelerator = EmulatedNpuAttention()
    set_accelerator(accelerator)
    yield accelerator.npu._torch_npu
    set_accelerator(None)


def _config(**extra):
    from megatron.core.transformer import TransformerConfig

    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, attention_dropout=0.0)
    values.update(extra)
    return TransformerConfig(masked_softmax_fusion=False, **values)


def _both(config, layer_number=1, **kwargs):
    """megatron-core's DotProductAttention and the fused one, same construction."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_npu.ops.attention import FusedDotProductAttention

    build = dict(layer_number=layer_number, attn_mask_type=AttnMaskType.causal, attention_type="self", **kwargs)
    fused = FusedDotProductAttention(config, **build)
    reference = DotProductAttention(config, **build)
    reference.load_state_dict(fused.state_dict())
    return reference, fused


def _qkv(sq=16, batch=2, heads=4, qk=8, v=8):
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(sq, batch, heads, qk, generator=generator)
    k = torch.randn(sq, batch, heads, qk, generator=generator)
    return q, k, torch.randn(sq, batch, heads, v, generator=generator)


def _document_mask(sq=16, batch=2) -> torch.Tensor:
    """megatron's reset-attention-mask: causal within each document, True = masked; [b, 1, sq, sk]."""
    mask = torch.ones(batch, 1, sq, sq).tril() < 0.5
    for row, boundary in ((0, 5), (1, 11)):  # documents [0, boundary) and [boundary, sq)
        mask[row, 0, boundary:, :boundary] = True
    return mask


def test_a_document_mask_reaches_the_fused_kernel(npu_attention):
    reference, fused = _both(_config())
    q, k, v = _qkv()
    mask = _document_mask()
    expected = reference(q, k, v, mask)
    got = fused(q, k, v, mask)
    assert npu_attention.calls[-1]["sparse_mode"] == 0  # the fused path ran, with the mask
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # the mask matters here: attending across documents gives another result
    assert not torch.allclose(fused(q, k, v, None), expected, atol=1e-3)


def test_sliding_window_layers_run_the_band_and_full_layers_the_causal_mask(npu_attention):
    config = _config(window_size=(3, 0), window_attn_skip_freq=2)
    q, k, v = _qkv()
    for layer_number, mode in ((1, 4), (2, 0)):  # layer 2 of every 2: full attention
        reference, fused = _both(config, layer_number=layer_number)
        torch.testing.assert_close(fused(q, k, v, None), reference(q, k, v, None), rtol=1e-5, atol=1e-6)
        assert npu_attention.calls[-1]["sparse_mode"] == mode
    assert npu_attention.calls[-2]["pre"] == 3 and npu_attention.calls[-2]["next"] == 0


def test_mla_head_sizes_run_fused_with_the_value_padded(npu_attention):
    config = _config()
    reference, fused = _both(config, softmax_scale=0.2, k_channels=12, v_channels=8)
    q, k, v = _qkv(qk=12, v=8)
    got = fused(q, k, v, None)
    assert got.shape == (16, 2, 4 * 8) and len(npu_attention.calls) == 1
    torch.testing.assert_close(got, reference(q, k, v, None), rtol=1e-5, atol=1e-6)


def test_attention_sinks_fall_back_to_megatron_cores_math(npu_attention):
    reference, fused = _both(_config(softmax_type="learnable"))
    with torch.no_grad():
        fused.softmax_offset.normal_()
        reference.softmax_offset.copy_(fused.softmax_offset)
    q, k, v = _qkv()
    torch.testing.assert_close(fused(q, k, v, None), reference(q, k, v, None))
    assert npu_attention.calls == []
