"""--apply-layernorm-1p (megatron-core's layernorm_zero_centered_gamma, Transformer Engine's zero_centered_gamma)
without Transformer Engine: the norm weight is stored as gamma - 1, starts at 0 and is applied as 1 + weight, for
LayerNorm and RMSNorm (the device's fused kernel where there is one), with sequence parallelism's marking kept; the
flag reaches megatron-core's TransformerConfig and every norm the local spec builds."""

from __future__ import annotations

import pytest
import torch

from megatron_npu.ops.norm import SequenceParallelTorchNorm

TINY_MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
    "--train-iters 1 --lr 1e-3 --mock-data"
).split()


class Config:
    def __init__(self, normalization: str, zero_centered: bool, sequence_parallel: bool = False) -> None:
        self.normalization = normalization
        self.layernorm_zero_centered_gamma = zero_centered
        self.sequence_parallel = sequence_parallel


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_a_zero_centered_norm_is_the_norm_with_one_plus_its_weight(kind):
    centered = SequenceParallelTorchNorm(Config(kind, True, sequence_parallel=True), 32, eps=1e-5)
    plain = SequenceParallelTorchNorm(Config(kind, False), 32, eps=1e-5)
    assert torch.equal(centered.weight, torch.zeros(32)) and torch.equal(plain.weight, torch.ones(32))
    assert all(p.sequence_parallel for p in centered.parameters())
    with torch.no_grad():
        centered.weight.normal_(generator=torch.Generator().manual_seed(1))
        plain.weight.copy_(centered.weight + 1)
        if kind == "LayerNorm":
            centered.bias.normal_(generator=torch.Generator().manual_seed(2))
            plain.bias.copy_(centered.bias)
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    out, out_plain = centered(x), plain(x_plain)
    torch.testing.assert_close(out, out_plain)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    out.backward(grad)
    out_plain.backward(grad)
    torch.testing.assert_close(x.grad, x_plain.grad)
    torch.testing.assert_close(centered.weight.grad, plain.weight.grad)  # d/dw (1 + w) = 1


def test_apply_layernorm_1p_builds_zero_centered_norms_in_megatron_cores_layers(model_parallel):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_npu.training.arguments import parse_args
    from megatron_npu.training.config import transformer_config

    args = parse_args(
        [*TINY_MODEL, "--apply-layernorm-1p", "--normalization", "RMSNorm", "--qk-layernorm"],
        world_size=1,
        check_paths=False,
    )
    config = transformer_config(args)
    assert config.layernorm_zero_centered_gamma
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    layer = TransformerLayer(config, spec.submodules)
    norms = {name: p for name, p in layer.named_parameters() if "layernorm" in name}
    assert {"input_layernorm.weight", "pre_mlp_layernorm.weight"} <= set(norms) and len(norms) >= 4
    assert all(torch.equal(p, torch.zeros_like(p)) for p in norms.values()), sorted(norms)
