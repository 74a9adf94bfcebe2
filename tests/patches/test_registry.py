"""The patch registry: idempotent, undoable, order-independent, alias-replacing."""

import os
import subprocess
import sys
import types

import pytest
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import megatron_npu
from megatron_npu.accelerator.cpu import CpuAccelerator
from megatron_npu.registry import Patch, PatchRegistry, original_of
from megatron_npu.version import UnsupportedMegatronVersion, check_megatron_core, release_for_patches


def make_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def double(original, accelerator):
    return lambda x: original(x) * 2


@pytest.fixture
def registry():
    reg = PatchRegistry()
    yield reg
    reg.undo()
    for name in [n for n in sys.modules if n.startswith("fake_mcore")]:
        del sys.modules[name]


def test_apply_replaces_the_target_and_every_early_bound_alias(registry):
    def inc(x):
        return x + 1

    target = make_module("fake_mcore_a", inc=inc)
    user = make_module("fake_mcore_user", inc=inc, other=inc)
    registry.register(Patch("inc", "fake_mcore_a:inc", double, "test", "test"))
    registry.apply(CpuAccelerator())
    assert target.inc(1) == 4 and user.inc(1) == 4 and user.other(1) == 4
    assert original_of(target.inc) is inc
    assert registry.alias_count("inc") == 2


def test_apply_is_idempotent(registry):
    target = make_module("fake_mcore_b", f=lambda x: x)
    registry.register(Patch("f", "fake_mcore_b:f", double, "test", "test"))
    registry.apply(CpuAccelerator())
    registry.apply(CpuAccelerator())
    assert target.f(1) == 2


def test_undo_restores_originals_and_aliases(registry):
    def f(x):
        return x

    target = make_module("fake_mcore_c", f=f)
    user = make_module("fake_mcore_c_user", f=f)
    registry.register(Patch("f", "fake_mcore_c:f", double, "test", "test"))
    registry.apply(CpuAccelerator())
    registry.undo()
    assert target.f is f and user.f is f
    assert registry.applied() == []
    registry.apply(CpuAccelerator())
    assert target.f(1) == 2


def test_module_imported_after_apply_is_patched_on_import(registry, tmp_path, monkeypatch):
    (tmp_path / "fake_mcore_late.py").write_text("def f(x):\n    return x\n")
    (tmp_path / "fake_mcore_late_user.py").write_text("from fake_mcore_late import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register(Patch("late", "fake_mcore_late:f", double, "test", "test"))
    registry.apply(CpuAccelerator())
    assert [p.name for p in registry.pending()] == ["late"]
    import fake_mcore_late_user

    assert fake_mcore_late_user.f(1) == 2
    assert registry.pending() == []


def test_patch_for_another_device_is_not_applied(registry):
    target = make_module("fake_mcore_d", f=lambda x: x)
    registry.register(Patch("fused-only", "fake_mcore_d:f", double, "test", "test", requires="has_fused_kernels"))
    registry.apply(CpuAccelerator())
    assert target.f(1) == 1


def test_a_missing_target_in_a_claimed_release_is_recorded_and_said_not_raised(registry, capfd):
    target = make_module("fake_mcore_e", kept=lambda x: x)
    registry.register(Patch("gone", "fake_mcore_e:vanished", double, "test", "test"))
    registry.register(Patch("deep", "fake_mcore_e:Nope.method", double, "test", "test"))
    registry.register(Patch("kept", "fake_mcore_e:kept", double, "test", "test"))
    registry.apply(CpuAccelerator())  # an import hook must not fail megatron-core's import: recorded instead
    assert sorted(registry.missing()) == ["deep", "gone"] and "does not exist" in registry.missing()["gone"]
    assert target.kept(1) == 2 and [p.name for p in registry.applied()] == ["kept"]
    assert capfd.readouterr().err.count("megatron-npu: error: patch") == 2  # said once each, not silent


def test_a_missing_module_is_a_missing_target_when_resolved(registry):
    registry.register(Patch("nomod", "fake_mcore_nowhere.sub:f", double, "test", "test"))
    registry.apply(CpuAccelerator())
    assert [p.name for p in registry.pending()] == ["nomod"]
    registry.resolve(("fake_mcore_nowhere",))
    assert registry.pending() == [] and "module does not exist" in registry.missing()["nomod"]


def test_version_guard_refuses_untested_megatron_core(monkeypatch):
    monkeypatch.delenv("MEGATRON_NPU_ALLOW_UNTESTED_MEGATRON", raising=False)
    with pytest.raises(UnsupportedMegatronVersion, match=r"0\.99\.0 is untested.*>=0\.12\.0"):
        check_megatron_core("0.99.0")
    with pytest.raises(UnsupportedMegatronVersion, match=r"0\.11\.0 is untested"):
        check_megatron_core("0.11.0")
    for release in ("0.12.1", "0.15.3", "0.16.1", "0.19.2"):
        assert check_megatron_core(release) == release


def test_version_guard_override_warns_and_picks_the_nearest_verified_releases_patches(monkeypatch):
    monkeypatch.setenv("MEGATRON_NPU_ALLOW_UNTESTED_MEGATRON", "1")
    with pytest.warns(RuntimeWarning, match="untested"):
        assert check_megatron_core("0.20.0") == "0.20.0"
    assert release_for_patches("0.20.0") == "0.19.2" and release_for_patches("0.11.0") == "0.12.1"
    assert release_for_patches("0.14.0") == "0.14.0"


def test_global_patch_set_maps_cuda_calls_on_cpu_and_unpatch_restores_them():
    assert megatron_npu.applied_patches(), "import megatron_npu applies the patch set"
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(1).cuda().device.type == "cpu"
    assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
    megatron_npu.unpatch()
    try:
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(2, device="cuda")
    finally:
        megatron_npu.patch()
    assert torch.zeros(2, device="cuda").device.type == "cpu"


def test_nccl_backend_is_mapped_and_gloo_groups_stay_gloo():
    from megatron_npu.patches.distributed import backend_mapper

    mapped = backend_mapper(CpuAccelerator())
    assert mapped("nccl") == "gloo"
    assert mapped("gloo") == "gloo"
    assert mapped(None) is None
    assert mapped("cpu:gloo,cuda:nccl") == "cpu:gloo"


def test_device_ids_follow_the_accelerators_answers_not_its_name():
    from megatron_npu.patches.device_arguments import device_mapper
    from megatron_npu.patches.distributed import _group_wrapper

    host = device_mapper(CpuAccelerator())
    assert host("cuda:3") == host(3) == host(torch.device("cuda", 1)) == torch.device("cpu")  # one host device
    assert host("meta") == "meta"
    seen = {}
    create = _group_wrapper(lambda *args, **kwargs: seen.update(kwargs), CpuAccelerator())
    create(backend="nccl", device_id=torch.device("cuda", 1))
    assert seen == {"backend": "gloo", "device_id": None}  # gloo on the host binds no device

    class Indexed(CpuAccelerator):  # a device target: indexed devices, groups bound to them
        runs_on_host = False

    assert device_mapper(Indexed())("cuda:3") == torch.device("cpu", 3)
    create = _group_wrapper(lambda *args, **kwargs: seen.update(kwargs), Indexed())
    create(device_id=torch.device("cuda", 1))
    assert seen["device_id"] == torch.device("cpu", 1)


def test_tensor_type_reports_cuda_names_only_inside_megatron_checks():
    from megatron.core.optimizer import clip_grads

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    assert param.type() == "torch.FloatTensor"
    # clip_grad_by_total_norm_fp32 asserts grad.type() == 'torch.cuda.FloatTensor'
    clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=2.0)
    assert torch.allclose(param.grad, torch.full((3,), 0.5), atol=1e-6)


def test_pipeline_outputs_are_kept_until_gloo_has_sent_them():
    """Freeing a stage's output right after its async send is safe only on stream-ordered backends."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    assert megatron_npu.applied_patches(), "import megatron_npu applies the patch set"
    config = ModelParallelConfig(
        pipeline_model_parallel_size=2, pipeline_dtype=torch.float32, deallocate_pipeline_outputs=True
    )
    assert config.deallocate_pipeline_outputs is False


def test_a_patch_outside_its_verified_releases_is_listed_not_applied(registry, monkeypatch):
    monkeypatch.setattr("megatron_npu.registry.installed_megatron_core", lambda: "0.14.0")
    target = make_module("fake_mcore_f", f=lambda x: x, g=lambda x: x)
    registry.register(Patch("new", "fake_mcore_f:f", double, "test", "test", megatron_versions=">=0.16"))
    registry.register(Patch("old", "fake_mcore_f:g", double, "test", "test", megatron_versions=">=0.12,<0.16"))
    registry.register(Patch("absent", "fake_mcore_f:only_in_016", double, "test", "test", megatron_versions=">=0.16"))
    registry.apply(CpuAccelerator())
    assert target.f(1) == 1 and target.g(1) == 2 and registry.release == "0.14.0"
    assert sorted(p.name for p in registry.other_release()) == ["absent", "new"]
    assert registry.missing() == {}  # a target of another release is not looked up


def test_every_patch_states_a_range_inside_the_supported_releases():
    from megatron_npu.registry import REGISTRY
    from megatron_npu.version import VERIFIED_RELEASES

    wheels = [Version(wheel) for wheel, _ in VERIFIED_RELEASES.values()]
    for patch in REGISTRY.patches:
        covered = [w for w in wheels if w in SpecifierSet(patch.megatron_versions)]
        assert covered, f"{patch.name}: {patch.megatron_versions} covers no verified release"
    targets: dict[str, list] = {}
    for patch in REGISTRY.patches:  # one target, several patches: their ranges must not overlap
        targets.setdefault(patch.target, []).append(patch)
    for target, patches in targets.items():
        for wheel in wheels:
            claiming = [
                p.name
                for p in patches
                if wheel in SpecifierSet(p.megatron_versions) and p.requires == patches[0].requires
            ]
            assert len(claiming) <= 1, (target, str(wheel), claiming)


def test_a_capability_the_accelerator_does_not_have_is_an_error_not_a_silent_skip():
    with pytest.raises(AttributeError, match="no boolean capability 'is_npu'"):
        CpuAccelerator().capability("is_npu")


def test_plain_megatron_core_optimizer_marks_the_decoupled_lr_group():
    """Found by the bit-exact --decoupled-lr resume test (test_pretrain_gpt.py): megatron-core
    matches checkpointed groups by is_decoupled_lr, which its own override left False."""
    import torch.distributed as dist
    from distributed import free_port
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    megatron_npu.patch()

    class Tiny(MegatronModule):
        def __init__(self) -> None:
            super().__init__(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1))
            self.embedding = torch.nn.Parameter(torch.zeros(16, 8))
            self.embedding.is_embedding_or_output_parameter = True
            self.hidden = torch.nn.Linear(8, 8)
            self.ddp_config = DistributedDataParallelConfig()  # what a DDP-wrapped chunk carries

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        config = OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, decoupled_lr=5e-3)
        optimizer = get_megatron_optimizer(config, [Tiny()])  # megatron-core's default overrides
        groups = optimizer.param_groups
        decoupled = [g for g in groups if g["max_lr"] == 5e-3]
        assert decoupled and all(g["is_decoupled_lr"] for g in decoupled)
        assert not any(g["is_decoupled_lr"] for g in groups if g["max_lr"] == 1e-3)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_jit_fusions_are_off_in_any_megatron_core_config_where_the_fuser_does_not_serve_the_device():
    from megatron.core.transformer.transformer_config import TransformerConfig

    megatron_npu.patch()
    shape = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 1}
    config = TransformerConfig(**shape, bias_activation_fusion=True, bias_dropout_fusion=True)
    assert (config.bias_activation_fusion, config.bias_dropout_fusion) == (False, False)  # cpu: no jit fusion


@pytest.mark.launch
def test_a_device_context_still_places_factory_calls_after_the_factories_are_wrapped():
    """transformers builds models under ``with torch.device("meta")``; found by the HF converter,
    whose logits were wrong after ``import megatron_npu`` (RoPE's inv_freq left uninitialised)."""
    code = (
        "import megatron_npu, torch\n"
        "with torch.device('meta'):\n"
        "    print(sorted({t.device.type for t in (torch.empty(2), torch.arange(3), torch.zeros(2), torch.ones(1))}))\n"
    )
    env = {**os.environ, "MEGATRON_NPU_DEVICE": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['meta']"
