"""megatron_npu/patches/moe_expert_bias.py: an expert's fc2 bias is not marked sequence-parallel.

finalize_model_grads all-reduces over TP the gradient of every parameter marked ``sequence_parallel`` under
``--sequence-parallel``; megatron-core marked the experts' fc2 biases too, whose gradients the expert-data-parallel
reduction already completes (gpt-oss at TP2 x EP2 x SP: rel 2.6e-4 off the 1-rank run; the end-to-end check is
tests/models/test_families.py's gpt-oss row). The dense layers' marks, which that sum needs, stay.
"""

from __future__ import annotations

import megatron_npu  # noqa: F401  (patches on import)
from megatron_npu.registry import REGISTRY


def _marked(module) -> dict[str, bool]:
    return {name: getattr(p, "sequence_parallel", False) for name, p in module.named_parameters()}


def test_expert_fc2_bias_is_not_summed_over_tp_but_dense_biases_are(model_parallel):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        num_moe_experts=2,
        moe_router_topk=2,
        add_bias_linear=True,
        use_cpu_initialization=True,
    )
    # the marks follow the flag alone; TransformerConfig refuses it at TP 1, the 1-rank world here
    config.sequence_parallel = True
    layer = TransformerLayer(config, get_gpt_layer_local_spec(num_experts=2).submodules)
    marked = _marked(layer)
    experts = {name: sp for name, sp in marked.items() if ".experts." in name}
    assert sorted(n for n in experts if n.endswith("linear_fc2.bias")) == [
        "mlp.experts.local_experts.0.linear_fc2.bias",
        "mlp.experts.local_experts.1.linear_fc2.bias",
    ]
    assert not any(experts.values()), experts
    # the dense parts still summed over TP under SP: attention's output bias, the norms, the router
    for name in ("self_attention.linear_proj.bias", "pre_mlp_layernorm.weight", "mlp.router.weight"):
        assert marked[name], name
    dense = RowParallelLinear(
        8, 8, config=config, init_method=lambda w: None, bias=True, input_is_parallel=True, skip_bias_add=True
    )
    assert dense.bias.sequence_parallel
    assert "RowParallelLinear.__init__.expert_bias_not_sequence_parallel" in {p.name for p in REGISTRY.applied()}
