"""megatron-core's CLIP / SigLIP vision encoder (``CLIPViTModel``) built without Transformer Engine.

megatron/core/models/vision/clip_vit_model.py picks its ``ln_pre`` / ``ln_post`` norm at import: ``TENorm`` with
Transformer Engine, else ``NORM_IMPL = torch.nn.LayerNorm``, bound as the default of ``CLIPViTModel.__init__``'s
``ln_pre_impl`` / ``ln_post_impl``. ``__init__`` builds either with ``build_module(impl, config=..., hidden_size=...,
eps=...)``, TENorm's signature, which ``torch.nn.LayerNorm`` does not take: without TE no CLIP ("clip") or SigLIP
("siglip") encoder can be built (``TypeError: LayerNorm.__init__() got an unexpected keyword argument 'config'``;
LLaVAModel builds one; megatron-core's own test_vlm_text_generation_controller.py on the cpu target).

Replaced: ``CLIPViTModel.__init__``, so that the torch LayerNorm fallback is resolved to megatron-core's own norm
for a TransformerConfig without TE, ``megatron.core.transformer.torch_norm.WrappedTorchNorm`` (the norm of its
local layer spec without apex; LayerNorm or RMSNorm by ``config.normalization`` as TENorm; on this project's targets
the SP-capable one ``patches/transformer.py`` puts there), read when the model is built. Any other norm (a spec,
TENorm) is passed on unchanged, so with TE nothing differs. The fallback and the signature are the same in
0.12-0.19 (0.16 added ``pg_collection`` / ``vp_stage``, bound by name here).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "vision"
_CLIP = "megatron.core.models.vision.clip_vit_model:CLIPViTModel"
#: megatron-core's no-TE ``NORM_IMPL``, which cannot be built from a config
FOREIGN_FALLBACK_NORM = torch.nn.LayerNorm
NORM_ARGUMENTS = ("ln_pre_impl", "ln_post_impl")


def config_norm(impl: Any) -> Any:
    """The norm megatron-core builds from a TransformerConfig in place of its unbuildable no-TE fallback."""
    if impl is not FOREIGN_FALLBACK_NORM:
        return impl
    from megatron.core.transformer import torch_norm  # the patched module attribute, read at build time

    return torch_norm.WrappedTorchNorm


@register(
    "vision.CLIPViTModel.no_te_norm",
    f"{_CLIP}.__init__",
    reason="without TE ln_pre / ln_post default to torch.nn.LayerNorm, which build_module calls with config= "
    "(TypeError: no CLIP or SigLIP encoder, no LLaVA, without TE); megatron-core's own norm for a config "
    "without TE (WrappedTorchNorm) is built instead",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.12.0,<0.20",
)
def _clip_norms(original: Callable, accelerator: Accelerator) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        for name in NORM_ARGUMENTS:
            bound.arguments[name] = config_norm(bound.arguments[name])
        original(*bound.args, **bound.kwargs)

    return __init__
