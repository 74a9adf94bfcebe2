"""megatron_npu/patches/vision.py: megatron-core's CLIPViTModel (CLIP / SigLIP encoders, LLaVA's vision tower) built
without Transformer Engine. Its no-TE ``ln_pre`` / ``ln_post`` default, ``torch.nn.LayerNorm``, was built with
``config=`` and raised TypeError; found by megatron-core's own test_vlm_text_generation_controller.py through
tests/conformance. In process, a 1-rank gloo world, a few seconds."""

from __future__ import annotations

import pytest
import torch

import megatron_npu  # noqa: F401  (patches on import)
from megatron_npu.patches.vision import config_norm
from megatron_npu.registry import REGISTRY


def _clip_class() -> type:
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel

    return CLIPViTModel


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **overrides})


def _layer_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec()


def test_the_no_te_fallback_is_the_one_patched():
    """Without TE megatron-core's default is torch.nn.LayerNorm; with TE it is TENorm and nothing is replaced."""
    from megatron.core.models.vision import clip_vit_model
    from megatron.core.transformer import torch_norm

    assert clip_vit_model.NORM_IMPL is torch.nn.LayerNorm
    assert config_norm(torch.nn.LayerNorm) is torch_norm.WrappedTorchNorm
    spec = object()
    assert config_norm(spec) is spec


@pytest.mark.parametrize(
    ("subtype", "norm", "class_tokens"), [("clip", "ln_pre", 1), ("siglip", "ln_post", 0)], ids=["clip", "siglip"]
)
def test_clip_and_siglip_encoders_build_and_run_without_te(model_parallel, subtype, norm, class_tokens):
    """The encoder's norm is megatron-core's norm for the config (LayerNorm of the hidden size with the config's
    epsilon, as TENorm would build it) and the encoder runs an image batch. Before: TypeError at construction."""
    config = _config(layernorm_epsilon=1e-6)
    model = _clip_class()(
        config,
        _layer_spec(),
        img_h=28,
        img_w=28,
        patch_dim=14,
        model_subtype=subtype,
        add_class_token=class_tokens > 0,
        class_token_len=class_tokens,
    )
    built = getattr(model, norm)
    assert isinstance(built, torch.nn.LayerNorm)
    assert built.normalized_shape == (16,) and built.eps == 1e-6
    out = model(torch.randn(3, 3, 28, 28))
    assert out.shape == (3, 4 + class_tokens, 16)  # [batch, patches (+ class tokens), hidden]
    assert torch.isfinite(out).all()


def test_rms_norm_config_gets_an_rms_norm(model_parallel):
    """TENorm follows config.normalization; so does the norm built in its place."""
    model = _clip_class()(_config(normalization="RMSNorm"), _layer_spec(), img_h=14, img_w=14, patch_dim=14)
    assert type(model.ln_pre).__name__ == "RMSNorm"


def test_megatron_cores_own_init_fails_without_te(model_parallel):
    """The defect the patch answers: megatron-core's own __init__, with its default norm."""
    original = REGISTRY.original_attribute(_clip_class(), "__init__")
    model = torch.nn.Module.__new__(_clip_class())
    with pytest.raises(TypeError, match="unexpected keyword argument 'config'"):
        original(model, _config(), _layer_spec(), img_h=14, img_w=14, patch_dim=14)
