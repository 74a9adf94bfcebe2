"""megatron_npu/patches/triton_imports.py, Emerging-Optimizers without triton: megatron-core 0.16's Muon (optimizer/muon.py)
imports Emerging-Optimizers v0.1.0, whose SYRK kernel module imports triton unguarded. Found by megatron-core's
dist_checkpointing/test_layer_wise_optimizer.py (optimizer='dist_muon', 119 tests) through tests/conformance."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

import megatron_npu  # noqa: F401  (patches on import)
from megatron_npu.accelerator.cpu import CpuAccelerator
from megatron_npu.patches.triton_imports import triton_importable
from megatron_npu.registry import REGISTRY, PatchRegistry

PATCH = "emerging_optimizers.triton_kernels.without_triton"
PACKAGE = "emerging_optimizers"
pytestmark = pytest.mark.skipif(triton_importable(), reason="triton is installed: the real kernels load")


@pytest.fixture
def package_modules():
    """The package's modules as they are now, restored after the test (a fake one loads in between)."""
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] == PACKAGE}
    for name in saved:
        del sys.modules[name]
    yield
    for name in [name for name in sys.modules if name.split(".")[0] == PACKAGE]:
        del sys.modules[name]
    sys.modules.update(saved)


def _fake_release(root) -> None:
    """A package laid out as Emerging-Optimizers v0.1.0 imports: the optimizers import the kernel module, which
    imports triton unguarded."""
    package = root / PACKAGE
    (package / "triton_kernels").mkdir(parents=True)
    (package / "orthogonalized_optimizers").mkdir()
    (package / "__init__.py").write_text("")
    (package / "triton_kernels" / "__init__.py").write_text("import triton\n\nHAS_TRITON_340 = True\n")
    (package / "orthogonalized_optimizers" / "__init__.py").write_text(
        "from emerging_optimizers import triton_kernels\n"
    )


def test_its_optimizers_import_without_triton_and_the_syrk_kernel_is_refused(tmp_path, monkeypatch, package_modules):
    _fake_release(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    # The process-wide registry's import hook may still wait for the real package: this test's registry alone
    # patches the fake one (two hooks would each look the module up through the other).
    monkeypatch.setattr(sys, "meta_path", [finder for finder in sys.meta_path if finder is not REGISTRY._hook])
    registry = PatchRegistry()
    registry.register(next(patch for patch in REGISTRY.patches if patch.name == PATCH))
    registry.apply(CpuAccelerator())
    try:
        optimizers = importlib.import_module(f"{PACKAGE}.orthogonalized_optimizers")  # without: no module 'triton'
        assert optimizers.triton_kernels.HAS_TRITON_340 is False
        with pytest.raises(RuntimeError, match="use_syrk"):
            optimizers.triton_kernels.tsyrk_ex(torch.ones(2, 2))
    finally:
        registry.undo()


@pytest.mark.skipif(importlib.util.find_spec(PACKAGE) is None, reason="Emerging-Optimizers is not installed")
def test_megatron_cores_muon_steps_without_triton(model_parallel):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.muon import HAVE_EMERGING_OPTIMIZERS, get_megatron_muon_optimizer

    assert HAVE_EMERGING_OPTIMIZERS  # without the patch: False (the import failed on triton)
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    class Tiny(MegatronModule):
        def __init__(self) -> None:
            super().__init__(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1))
            self.linear = torch.nn.Linear(8, 8, bias=False)

    torch.manual_seed(0)
    model = Tiny()
    model.ddp_config = DistributedDataParallelConfig()  # what a DDP-wrapped chunk carries
    before = model.linear.weight.detach().clone()
    optimizer = get_megatron_muon_optimizer(OptimizerConfig(optimizer="muon", lr=0.1, bf16=False), [model])
    model.linear(torch.randn(4, 8)).square().sum().backward()
    optimizer.step()
    assert not torch.equal(model.linear.weight, before)
