"""megatron-core's spec-building seams (backend spec provider, MoE module spec) across releases.

- ``LocalSpecProvider`` (``megatron.core.models.backends``, 0.13+): megatron-core's local modules behind the
  ``BackendSpecProvider`` seam. 0.12 has no such module: the same answers from 0.12's local modules.
- ``moe_module_spec``: ``get_moe_module_spec_for_backend`` (0.13+). Its backend call changed in 0.17:
  ``grouped_mlp_modules(grouped, legacy)`` returned ``(module, submodules)`` up to 0.16, and from 0.17
  ``grouped_mlp_modules(grouped)`` returns a builder (the module bound to its submodules); the provider here
  answers the 0.13-0.16 form and is adapted for 0.17+. 0.12 has no backend function: the MoE layer's spec
  is built from the provider the same way (megatron-core's MoELayer, its SharedExpertMLP).
- ``mlp_submodules``: a layer spec's MLP submodules (a ModuleSpec up to 0.17, a builder from 0.18).
- ``get_transformer_layer_offset`` / ``get_num_layers_to_build``: megatron-core's, taking ``vp_stage`` (0.13+).
Imported only by modules that already import megatron-core (ops/spec_provider.py, spec.py).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_npu.compat.core import call_with_vp_stage, find

_CoreLocalSpecProvider = find("megatron.core.models.backends", "LocalSpecProvider")


class _LocalSpecProvider012:
    """0.12: what 0.13's LocalSpecProvider answers, from the local modules 0.12's get_gpt_layer_local_spec uses
    (the project's provider overrides norm, attention, activation and experts)."""

    def column_parallel_linear(self) -> type:
        return ColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return RowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return False

    def column_parallel_layer_norm_linear(self) -> type | None:
        return None


LocalSpecProvider: type = _CoreLocalSpecProvider or _LocalSpecProvider012


def moe_module_spec(backend: Any, num_experts: int, moe_grouped_gemm: bool) -> ModuleSpec:
    """The MoE layer's spec from ``backend`` (experts, shared experts), on every supported release."""
    core = find("megatron.core.models.gpt.moe_module_specs", "get_moe_module_spec_for_backend")
    if core is None:
        return _moe_module_spec_012(backend, num_experts, moe_grouped_gemm)
    parameters = inspect.signature(core).parameters
    kwargs: dict[str, Any] = {"num_experts": num_experts, "moe_grouped_gemm": moe_grouped_gemm}
    if "use_te_activation_func" in parameters:  # 0.15+
        kwargs["use_te_activation_func"] = False
    if "moe_use_legacy_grouped_gemm" not in parameters:  # 0.17+: the experts come as a builder
        backend = _ExpertsBuilder(backend)
    return core(backend, **kwargs)


class _ExpertsBuilder:
    """A 0.13-0.16 style provider for 0.17+'s MoE spec: ``grouped_mlp_modules(grouped)`` returns the experts'
    module bound to its submodules (0.17's ExpertsBuilder); everything else is the provider's own."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool) -> Any:
        module, submodules = self._backend.grouped_mlp_modules(moe_use_grouped_gemm, False)
        return functools.partial(module, submodules=submodules)


def _moe_module_spec_012(backend: Any, num_experts: int, moe_grouped_gemm: bool) -> ModuleSpec:
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    module, submodules = backend.grouped_mlp_modules(moe_grouped_gemm, False)
    shared_mlp = MLPSubmodules(linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear())
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=ModuleSpec(module=module, submodules=submodules),
            shared_experts=ModuleSpec(module=SharedExpertMLP, params={"gate": False}, submodules=shared_mlp),
        ),
    )


def get_transformer_layer_offset(config: Any, vp_stage: int | None = None) -> int:
    """megatron-core's first global layer index of this stage (``vp_stage``: 0.13+; see core.call_with_vp_stage)."""
    from megatron.core.transformer import transformer_layer

    return call_with_vp_stage(transformer_layer.get_transformer_layer_offset, config, vp_stage=vp_stage)


def get_num_layers_to_build(config: Any, vp_stage: int | None = None) -> int:
    """megatron-core's layer count of this stage (``vp_stage``: 0.13+; see core.call_with_vp_stage)."""
    from megatron.core.transformer import transformer_block

    return call_with_vp_stage(transformer_block.get_num_layers_to_build, config, vp_stage=vp_stage)


def mlp_submodules(mlp: Any) -> MLPSubmodules:
    """The MLPSubmodules of a layer spec's MLP: a ModuleSpec's ``submodules`` up to 0.17; from 0.18 the local
    spec's MLP is a builder, ``partial(MLP.as_mlp_submodule, submodules=...)``, which holds them as a keyword."""
    if isinstance(mlp, functools.partial):
        return mlp.keywords["submodules"]
    return mlp.submodules
