"""Fused-op layer: the torch twin of every fused kernel computes what megatron-core computes unfused.

On npu the same functions call torch_npu's kernels (their names and arguments are
checked against the real wheel in test_npu_contract.py); here the torch math runs.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from megatron_npu.accelerator import set_accelerator
from megatron_npu.accelerator.cpu import CpuAccelerator
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


def test_the_one_fused_op_patch_is_the_rope_slot_with_megatrons_signature(rope_utils):
    """Norm, attention and SwiGLU go through the spec provider; RoPE has no seam, so a patch fills
    megatron-core's fused-RoPE slot (Transformer Engine's signature: megatron calls it with interleaved=...)."""
    from megatron_npu.registry import REGISTRY

    patches = {p.target: p for p in REGISTRY.patches if p.subsystem == "fused_ops"}
    rope_slot = "megatron.core.models.common.embeddings.rope_utils:fused_apply_rotary_pos_emb"
    assert set(patches) == {rope_slot}
    assert patches[rope_slot].requires == "has_fused_rotary"
    rope = patches[rope_slot].build(None, RecordingAccelerator())
    assert list(inspect.signature(rope).parameters) == ["t", "freqs", "transpose_output_memory", "interleaved"]


class RecordingAccelerator(CpuAccelerator):
    """A cpu target that claims every fused kernel; each kernel records its call and runs the torch twin."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def fused_ops(self) -> dict[str, bool]:
        return dict.fromkeys(super().fused_ops(), True)

    def fused_kernel(self, key: str):
        twins = {
            "rotary": lambda t, cos, sin: t * cos + fused._rotate_half(t) * sin,
            "swiglu": lambda x: F.silu(x.chunk(2, dim=-1)[0]) * x.chunk(2, dim=-1)[1],
            "rms_norm": lambda x, weight, eps: F.rms_norm(x, weight.shape, weight, eps),
        }
        if key not in twins:
            return None

        def kernel(*args, **kwargs):
            self.calls.append(key)
            return twins[key](*args, **kwargs)

        return kernel


@pytest.fixture
def recording(monkeypatch, rope_utils):
    """The recording accelerator, with megatron-core's fused-RoPE slot filled as on a device with the kernel."""
    from megatron_npu.registry import REGISTRY

    accelerator = RecordingAccelerator()
    set_accelerator(accelerator)
    (rope,) = [p for p in REGISTRY.patches if p.target.endswith(":fused_apply_rotary_pos_emb")]
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", rope.build(None, accelerator))
    yield accelerator
    set_accelerator(None)


# a model parse_args accepts, small enough to build configs from
TINY_MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
    "--train-iters 1 --lr 1e-3 --mock-data"
).split()


@pytest.mark.parametrize("flag, fused_kernel_runs", [([], True), (["--no-rope-fusion"], False)])
def test_rope_fusion_flag_decides_between_the_kernel_and_the_unfused_math(
    recording, rope_utils, flag, fused_kernel_runs
):
    from megatron_npu.training.arguments import parse_args
    from megatron_npu.training.config import transformer_config

    args = parse_args([*TINY_MODEL, "--position-embedding-type", "rope", *flag], world_size=1, check_paths=False)
    config = transformer_config(args)
    assert config.apply_rope_fusion is fused_kernel_runs
    generator = torch.Generator().manual_seed(0)
    t, freqs = torch.randn(12, 2, 4, 16, generator=generator), torch.randn(12, 1, 1, 16, generator=generator)
    # megatron-core's own dispatcher; any non-None cp_group skips its parallel_state lookup (bshd ignores it)
    out = rope_utils.apply_rotary_pos_emb(t, freqs, config, cp_group=object())
    assert recording.calls == (["rotary"] if fused_kernel_runs else [])
    torch.testing.assert_close(out, rope_utils._apply_rotary_pos_emb_bshd(t, freqs), rtol=0, atol=1e-6)


def test_no_rope_fusion_holds_on_a_target_without_transformer_engine_or_kernel():
    """The cpu target: no kernel, so the flag's default still runs megatron's unfused math."""
    from megatron_npu.training.arguments import parse_args
    from megatron_npu.training.config import rope_fusion

    args = parse_args([*TINY_MODEL, "--position-embedding-type", "rope"], world_size=1, check_paths=False)
    assert args.training.apply_rope_fusion and not args.model.rotary_interleaved
    assert rope_fusion(args) is False


def test_norm_and_swiglu_route_through_the_accelerator_kernel_with_neutral_signatures(recording):
    x = torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(5))
    norm = fused.RMSNorm(32, eps=1e-5)
    torch.testing.assert_close(norm(x), torch.nn.RMSNorm(32, eps=1e-5)(x))
    gate, linear = x.chunk(2, dim=-1)
    torch.testing.assert_close(fused.swiglu(x), F.silu(gate) * linear)
    assert recording.calls == ["rms_norm", "swiglu"]


def swiglu_args(*flags: str):
    from megatron_npu.training.arguments import parse_args

    return parse_args([*TINY_MODEL, "--swiglu", *flags], world_size=1, check_paths=False)


@pytest.mark.parametrize("flag, fused_kernel_runs", [([], True), (["--no-bias-swiglu-fusion"], False)])
def test_swiglu_fusion_flag_decides_between_the_kernel_module_and_megatrons_unfused_glu(
    recording, flag, fused_kernel_runs
):
    from megatron_npu.spec import gpt_layer_spec
    from megatron_npu.training.config import transformer_config

    args = swiglu_args(*flag)
    config = transformer_config(args)
    # megatron's MLP builds the spec'd activation only under use_te_activation_func, else runs its own glu
    assert config.use_te_activation_func is fused_kernel_runs
    assert config.bias_activation_fusion is False  # the jit fusion: none on this target either way
    activation = gpt_layer_spec(args).submodules.mlp.submodules.activation_func(config)
    x = torch.randn(3, 2, 32, generator=torch.Generator().manual_seed(6))
    gate, linear = x.chunk(2, dim=-1)
    torch.testing.assert_close(activation(x), F.silu(gate) * linear)
    assert recording.calls == ["swiglu"]


def test_swiglu_runs_megatrons_unfused_glu_on_a_target_without_the_kernel():
    from megatron_npu.training.config import transformer_config

    config = transformer_config(swiglu_args())
    assert (config.use_te_activation_func, config.bias_activation_fusion) == (False, False)


@pytest.mark.parametrize("use_flash_attn", [False, True])
def test_spec_provider_selects_fused_attention_only_for_use_flash_attn_on_a_device_with_the_kernel(
    monkeypatch, use_flash_attn
):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_npu.ops.attention import FusedDotProductAttention
    from megatron_npu.ops.norm import SequenceParallelTorchNorm
    from megatron_npu.spec import gpt_layer_spec
    from megatron_npu.training.arguments import parse_args

    flags = [*TINY_MODEL, "--qk-layernorm", "--normalization", "RMSNorm", *(["--use-flash-attn"] * use_flash_attn)]
    args = parse_args(flags, world_size=1, check_paths=False, check_target=False)  # a dense model

    class WithAttention(CpuAccelerator):
        def fused_kernel(self, key):
            return (lambda *a, **k: None) if key == "flash_attention" else None

    for accelerator, expected in (
        (CpuAccelerator(), DotProductAttention),
        (WithAttention(), FusedDotProductAttention if use_flash_attn else DotProductAttention),
    ):
        set_accelerator(accelerator)
        try:
            layer = gpt_layer_spec(args).submodules
        finally:
            set_accelerator(None)
        assert layer.self_attention.submodules.core_attention is expected
        assert layer.input_layernorm is layer.pre_mlp_layernorm is SequenceParallelTorchNorm
        assert layer.self_attention.submodules.q_layernorm is SequenceParallelTorchNorm


def test_flash_attention_twin_equals_megatron_dot_product_attention_with_gqa(model_parallel):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_npu.ops.attention import FusedDotProductAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=2,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
    )
    attention = FusedDotProductAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(16, 2, 8, 8, generator=generator)  # [sq, b, heads, head_dim]
    key, value = (torch.randn(16, 2, 2, 8, generator=generator) for _ in range(2))  # 2 query groups
    unfused = attention(query, key, value, None)  # no kernel on cpu: megatron-core's own attention
    twin = fused.flash_attention(query, key, value, softmax_scale=attention.softmax_scale)
    assert unfused.shape == twin.shape == (16, 2, 64)
    torch.testing.assert_close(twin, unfused, rtol=1e-5, atol=1e-6)


def test_megatrons_mlp_runs_the_device_swiglu_module_and_checkpoints_the_same_keys(model_parallel, recording):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_npu.spec import gpt_layer_spec
    from megatron_npu.training.config import transformer_config

    mlps = {}
    for flag in ([], ["--no-bias-swiglu-fusion"]):
        args = swiglu_args(*flag)
        mlps[bool(flag)] = build_module(gpt_layer_spec(args).submodules.mlp, config=transformer_config(args))
    mlps[True].load_state_dict(mlps[False].state_dict())
    x = torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(7))
    recording.calls.clear()
    fused_out, _ = mlps[False](x)
    assert recording.calls == ["swiglu"]
    unfused_out, _ = mlps[True](x)
    assert recording.calls == ["swiglu"]  # --no-bias-swiglu-fusion: megatron's own glu, no kernel
    torch.testing.assert_close(fused_out, unfused_out)
    from megatron.core import parallel_state

    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    keys = [set(mlp.sharded_state_dict(metadata=metadata)) for mlp in mlps.values()]
    assert keys[0] == keys[1]  # the activation module holds no state: checkpoints load across the flag
