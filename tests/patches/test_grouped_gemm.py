"""megatron_npu/patches/grouped_gemm.py: megatron-core 0.12-0.16's legacy GroupedMLP (``--moe-grouped-gemm``, local
spec) on the project's grouped GEMM where the ``grouped_gemm`` package (CUDA kernels) is absent. Found by
megatron-core's test_moe_layer.py::TestMoELayerInit::test_legacy_moe_layer[True-*] and dist_checkpointing/
test_optimizer.py::TestOptimizerResharding::test_chained_optimizer_resharding[*-False-True-*] (assert at
construction), and by Megatron-LM's pretrain_gpt.py on the DeepSeek-V2-Lite recipe."""

from __future__ import annotations

import argparse
import importlib.util
import types

import pytest
import torch
from torch.nn import functional

import megatron_npu  # noqa: F401  (patches on import)
from megatron_npu.accelerator import get_accelerator
from megatron_npu.patches import grouped_gemm as patch
from megatron_npu.patches.megatron_training import _grouped_gemm_capability

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("grouped_gemm") is not None, reason="the grouped_gemm package is installed: it serves"
)


def _per_expert(a: torch.Tensor, b: torch.Tensor, counts: list[int], trans_b: bool) -> torch.Tensor:
    parts = torch.split(a, counts)
    return torch.cat([part @ (w.t() if trans_b else w) for part, w in zip(parts, b.unbind(0), strict=True)])


def test_megatron_core_finds_a_grouped_gemm_without_the_package():
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    assert gg.grouped_gemm_is_available()
    gg.assert_grouped_gemm_is_available()
    assert gg.ops.gmm is not None and patch.serves_grouped_gemm()
    with pytest.raises(ImportError):  # nothing shadows the package itself
        import grouped_gemm  # noqa: F401


@pytest.mark.parametrize("trans_b", [False, True])
def test_gmm_is_the_per_expert_math_forward_and_backward(trans_b: bool):
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    torch.manual_seed(0)
    counts = [3, 0, 5]  # an expert without tokens, as the router leaves them
    a = torch.randn(sum(counts), 4, requires_grad=True)
    b = torch.randn(3, 6, 4, requires_grad=True) if trans_b else torch.randn(3, 4, 6, requires_grad=True)
    out = gg.ops.gmm(a, b, torch.tensor(counts), trans_b=trans_b)
    grad = torch.randn_like(out)
    out.backward(grad)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    expected = _per_expert(a2, b2, counts, trans_b)
    expected.backward(grad)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


def test_the_legacy_grouped_mlp_builds_and_computes_its_experts(model_parallel):
    """megatron-core's GroupedMLP (bf16 only, as upstream) against its own weights' per-expert math."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import GroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        num_moe_experts=2,
        moe_ffn_hidden_size=4,
        moe_router_topk=2,
        moe_grouped_gemm=True,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=functional.silu,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=True,
    )
    spec = get_gpt_layer_local_spec(num_experts=2, moe_grouped_gemm=True)
    experts = MoELayer(config, spec.submodules.mlp.submodules).experts
    assert isinstance(experts, GroupedMLP)
    torch.manual_seed(0)
    counts = [3, 2]
    hidden = torch.randn(5, 8, dtype=torch.bfloat16)
    probs = torch.rand(5, dtype=torch.bfloat16)
    out, _ = experts(hidden, torch.tensor(counts), probs)
    w1 = experts.weight1.view(2, 8, -1)
    w2 = experts.weight2.view(2, -1, 8)
    fc1 = _per_expert(hidden, w1, counts, trans_b=False)
    gate, linear = torch.chunk(fc1, 2, dim=-1)
    activated = (functional.silu(gate) * linear * probs.unsqueeze(-1)).to(torch.bfloat16)
    torch.testing.assert_close(out, _per_expert(activated, w2, counts, trans_b=False))


def test_an_installed_package_is_never_shadowed():
    package = types.SimpleNamespace(ops=types.SimpleNamespace(gmm=lambda *args, **kwargs: None))
    accelerator = get_accelerator()
    assert patch._grouped_gemm(package, accelerator) is package
    assert patch._ops(package.ops, accelerator) is package.ops
    assert patch._grouped_gemm(None, accelerator) is patch.STAND_IN


def test_megatron_lm_validate_args_grouped_gemm_arch_check_passes_only_while_the_project_serves():
    """Megatron-LM's validate_args: ``assert torch.cuda.get_device_capability()[0] >= 8`` under --moe-grouped-gemm
    ("Unsupported compute capability for GroupedGEMM kernels"); the patched capability off CUDA is (0, 0)."""
    before = torch.cuda.get_device_capability()
    with _grouped_gemm_capability(argparse.Namespace(moe_grouped_gemm=True)):
        assert torch.cuda.get_device_capability()[0] >= 8
    assert torch.cuda.get_device_capability() == before
    with _grouped_gemm_capability(argparse.Namespace(moe_grouped_gemm=False)):
        assert torch.cuda.get_device_capability() == before
