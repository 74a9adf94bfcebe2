"""The reference torch_npu operators (npu_reference.py) against plain torch math on random inputs and against the
torch_npu 2.14.0 wheel's signatures; and the npu accelerator's own calls over them (the project's calling
conventions meet the documented constraints)."""

from __future__ import annotations

import ast
import inspect
import zipfile

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from accelerator import npu_reference as ref
from accelerator.test_npu_contract import npu_attributes_used

ALL = ref.ALL_TOKENS


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def _plain_attention(q, k, v, kept, scale):
    """[B, N, S, D] torch math: softmax(scale q k^T masked) v, key heads repeated to the query heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if kept is not None:
        scores = scores.masked_fill(~kept, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v, scores


def _compressed() -> torch.Tensor:
    return torch.ones(2048, 2048, dtype=torch.bool).triu(1)


# ---- signatures: the wheel's meta registrations --------------------------------------------------------------------


def _meta_functions(wheel: zipfile.ZipFile) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(wheel.read("torch_npu/op_plugin/meta/_meta_registrations.py").decode())
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Call) and len(decorator.args) >= 2:
                    name = getattr(decorator.args[1], "value", None)
                    if name in ref.OPERATORS:
                        found[name] = node
    return found


def _wheel_parameters(function: ast.FunctionDef) -> list[tuple[str, str, object]]:
    """(name, kind, default) of every parameter, as inspect names the kinds."""
    args = function.args
    positional = [(a.arg, "POSITIONAL_OR_KEYWORD") for a in args.args]
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults
    ]
    keyword = [(a.arg, "KEYWORD_ONLY") for a in args.kwonlyargs]
    kw_defaults = [inspect.Parameter.empty if d is None else ast.literal_eval(d) for d in args.kw_defaults]
    return [(n, k, d) for (n, k), d in zip(positional + keyword, defaults + kw_defaults, strict=True)]


def test_every_reference_operator_has_the_wheels_parameters_and_defaults(torch_npu_wheel):
    meta = _meta_functions(torch_npu_wheel)
    assert set(meta) == set(ref.OPERATORS)
    for name, operator in ref.OPERATORS.items():
        ours = [(p.name, p.kind.name, p.default) for p in inspect.signature(operator).parameters.values()]
        assert ours == _wheel_parameters(meta[name]), name


def test_the_torch_npu_module_holds_every_name_the_npu_accelerator_uses():
    module = ref.build_torch_npu()
    assert npu_attributes_used("_npu") <= set(vars(module.npu))
    assert npu_attributes_used("_torch_npu", "profiler") <= set(vars(module.profiler))
    assert torch.npu is module.npu  # importing torch_npu registers torch.npu


def test_the_host_torch_npu_has_one_device_per_local_rank_and_the_host_rng(monkeypatch):
    npu = ref.host_npu_namespace()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    npu.set_device(1)
    assert (npu.device_count(), npu.current_device()) == (2, 1)
    with pytest.raises(RuntimeError, match="out of range"):
        npu.set_device(2)
    with torch.random.fork_rng(devices=[]):  # the suite's host RNG is left as it was
        npu.manual_seed(7)
        drawn = torch.rand(3, generator=npu.default_generators[1])
        torch.default_generator.manual_seed(7)
        torch.testing.assert_close(drawn, torch.rand(3))  # megatron's RNG tracker forks the host generator
        torch.testing.assert_close(npu.get_rng_state(), torch.get_rng_state())


# ---- npu_fusion_attention -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
def test_fusion_attention_layouts_and_gqa_equal_the_torch_math(layout):
    b, n, g, s, d = 2, 4, 2, 6, 8
    q, k, v = _randn(b, n, s, d, seed=1), _randn(b, g, s, d, seed=2), _randn(b, g, s, d, seed=3)
    expected, scores = _plain_attention(q, k, v, None, 0.3)

    def to_layout(x):
        return {
            "BNSD": x,
            "BSND": x.transpose(1, 2),
            "BSH": x.transpose(1, 2).flatten(2),
            "SBH": x.permute(2, 0, 1, 3).flatten(2),
        }[layout].contiguous()

    out, row_max, row_sum, reserved, seed, offset, numels = ref.npu_fusion_attention(
        to_layout(q), to_layout(k), to_layout(v), n, layout, scale=0.3
    )
    torch.testing.assert_close(out, to_layout(expected), rtol=1e-5, atol=1e-6)
    # the statistics: [B, N, S, 8] fp32, max + log(sum) = the row's logsumexp
    assert row_max.shape == row_sum.shape == (b, n, s, 8) and row_max.dtype == torch.float32
    assert (seed, offset, numels) == (0, 0, 0) and reserved.numel() == 0
    torch.testing.assert_close(row_max[..., 0] + row_sum[..., 0].log(), scores.logsumexp(-1), rtol=1e-5, atol=1e-5)


def test_atten_mask_true_is_masked_and_a_document_mask_is_applied_as_given():
    b, n, s, d = 2, 2, 8, 4
    q, k, v = _randn(b, n, s, d, seed=4), _randn(b, n, s, d, seed=5), _randn(b, n, s, d, seed=6)
    mask = torch.ones(b, 1, s, s).tril() < 0.5  # causal, True = masked
    mask[0, 0, 3:, :3] = True  # document boundary at 3 in sample 0
    expected, _ = _plain_attention(q, k, v, ~mask, 0.5)
    got = ref.npu_fusion_attention(q, k, v, n, "BNSD", atten_mask=mask, scale=0.5)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # the causal call (triangle, next_tockens 0): consistent band; a band that drops kept keys is refused
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    ref.npu_fusion_attention(q, k, v, n, "BNSD", atten_mask=causal, next_tockens=0)
    with pytest.raises(ref.DocumentedMisuse, match="outside pre_tockens"):
        ref.npu_fusion_attention(q, k, v, n, "BNSD", atten_mask=causal, pre_tockens=2, next_tockens=0)


def test_without_a_mask_sparse_mode_and_the_band_take_no_effect():
    """ "当atten_mask输入为None时, sparse_mode, pre_tockens, next_tockens参数不生效, 固定为全计算": next_tockens=0
    alone is not causal."""
    q, k, v = _randn(1, 2, 6, 4, seed=7), _randn(1, 2, 6, 4, seed=8), _randn(1, 2, 6, 4, seed=9)
    full, _ = _plain_attention(q, k, v, None, 1.0)
    for mode in (0, 2, 3, 4):
        got = ref.npu_fusion_attention(q, k, v, 2, "BNSD", next_tockens=0, pre_tockens=0, sparse_mode=mode)[0]
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sq, sk", [(6, 6), (4, 7), (7, 4)])
def test_sparse_modes_1_to_4_against_their_documented_masks(sq, sk):
    q, k, v = _randn(1, 2, sq, 4, seed=10), _randn(1, 2, sk, 4, seed=11), _randn(1, 2, sk, 4, seed=12)
    rows, cols = torch.arange(sq).view(-1, 1), torch.arange(sk).view(1, -1)
    documented = {
        2: cols <= rows,  # leftUpCausal: from the top-left corner
        3: cols <= rows + (sk - sq),  # rightDownCausal: from the bottom-right corner
        4: (cols >= rows + (sk - sq) - 2) & (cols <= rows + (sk - sq) + 1),  # band pre 2 / next 1, bottom-right
    }
    for mode, kept in documented.items():
        got = ref.npu_fusion_attention(
            q, k, v, 2, "BNSD", atten_mask=_compressed(), sparse_mode=mode, pre_tockens=2, next_tockens=1
        )[0]
        expected, _ = _plain_attention(q, k, v, kept, 1.0)
        valid = kept.any(-1)  # rows with no key: 0 (invalid-row computation)
        torch.testing.assert_close(got[:, :, valid], expected[:, :, valid], rtol=1e-5, atol=1e-6)
        assert not got[:, :, ~valid].any()
    all_mask = torch.rand(sq, sk, generator=torch.Generator().manual_seed(3)) < 0.3
    all_mask[:, 0] = False
    expected, _ = _plain_attention(q, k, v, ~all_mask, 1.0)
    got = ref.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=all_mask, sparse_mode=1, pre_tockens=0)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)  # allMask ignores the band
    with pytest.raises(ref.DocumentedMisuse, match="compressed 2048"):
        ref.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=all_mask, sparse_mode=4)
    with pytest.raises(NotImplementedError):
        ref.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=_compressed(), sparse_mode=6)


def test_tnd_attends_within_each_cumulative_segment():
    n, d = 2, 4
    lengths_q, lengths_k = [3, 2, 4], [3, 5, 4]
    q, k, v = _randn(9, n, d, seed=13), _randn(12, n, d, seed=14), _randn(12, n, d, seed=15)
    cum_q, cum_k = [3, 5, 9], [3, 8, 12]
    out, row_max, _, *_ = ref.npu_fusion_attention(
        q, k, v, n, "TND", atten_mask=_compressed(), sparse_mode=3, actual_seq_qlen=cum_q, actual_seq_kvlen=cum_k
    )
    assert out.shape == (9, n, d) and row_max.shape == (n, 9, 8)  # default softmax layout: NTD
    q0 = k0 = 0
    for lq, lk in zip(lengths_q, lengths_k, strict=True):
        seg = lambda t, a, length: t[a : a + length].permute(1, 0, 2).unsqueeze(0)  # noqa: E731
        kept = torch.arange(lk).view(1, -1) <= torch.arange(lq).view(-1, 1) + (lk - lq)
        expected, _ = _plain_attention(seg(q, q0, lq), seg(k, k0, lk), seg(v, k0, lk), kept, 1.0)
        torch.testing.assert_close(out[q0 : q0 + lq], expected[0].permute(1, 0, 2), rtol=1e-5, atol=1e-6)
        q0, k0 = q0 + lq, k0 + lk
    tnd = ref.npu_fusion_attention(
        q, k, v, n, "TND", actual_seq_qlen=cum_q, actual_seq_kvlen=cum_k, softmax_layout="TND"
    )
    assert tnd[1].shape == (9, n, 8)


def test_keep_prob_drops_scores_and_the_grad_regenerates_the_same_mask():
    b, n, s, d = 1, 2, 16, 4
    q, k, v = (_randn(b, n, s, d, seed=i).requires_grad_() for i in (16, 17, 18))
    torch.manual_seed(0)
    out, _, _, _, seed, _, numels = ref.npu_fusion_attention(q, k, v, n, "BNSD", keep_prob=0.5)
    assert numels == b * n * s * s
    keep = ref._dropout_keep((b, n, s, s), 0.5, seed, q.device)
    assert 0.3 < keep.float().mean() < 0.7
    probs = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    expected = (probs * keep / 0.5) @ v
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    d_out = _randn(b, n, s, d, seed=19)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    torch.testing.assert_close(grads, torch.autograd.grad(expected, (q, k, v), d_out), rtol=1e-4, atol=1e-5)


def test_the_grad_from_the_forwards_statistics_equals_autograd_of_the_torch_math():
    s, b, n, g, d = 6, 2, 4, 2, 8
    q, k, v = (_randn(s, b, h * d, seed=i).requires_grad_() for i, h in ((20, n), (21, g), (22, g)))
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    out, row_max, row_sum, *_ = ref.fusion_attention_forward(q, k, v, n, "SBH", atten_mask=causal, scale=0.4)
    dy = _randn(s, b, n * d, seed=23)

    def bnsd(x, heads):
        return x.view(s, b, heads, d).permute(1, 2, 0, 3)

    plain, _ = _plain_attention(bnsd(q, n), bnsd(k, g), bnsd(v, g), ~causal, 0.4)
    expected = torch.autograd.grad(plain.permute(2, 0, 1, 3).reshape(s, b, -1), (q, k, v), dy)
    statistics = {"softmax_max": row_max, "softmax_sum": row_sum, "attention_in": out}
    dq, dk, dv, dpse, _ = ref.npu_fusion_attention_grad(
        q, k, v, dy, n, "SBH", atten_mask=causal, scale_value=0.4, **statistics
    )
    torch.testing.assert_close((dq, dk, dv), expected, rtol=1e-4, atol=1e-5)
    assert dpse is None
    # through autograd, as torch_npu registers the op: the same gradients
    got = torch.autograd.grad(
        ref.npu_fusion_attention(q, k, v, n, "SBH", atten_mask=causal, scale=0.4)[0], (q, k, v), dy
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_ring_attention_update_merges_two_key_blocks_into_the_whole_rows_attention():
    s, b, n, d = 5, 2, 2, 4
    q, k, v = _randn(s, b, n * d, seed=24), _randn(8, b, n * d, seed=25), _randn(8, b, n * d, seed=26)
    whole = ref.npu_fusion_attention(q, k, v, n, "SBH")
    first = ref.npu_fusion_attention(q, k[:3], v[:3], n, "SBH")
    second = ref.npu_fusion_attention(q, k[3:], v[3:], n, "SBH")
    out, row_max, row_sum = ref.npu_ring_attention_update(*first[:3], *second[:3])
    torch.testing.assert_close(out, whole[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(row_max, whole[1])
    torch.testing.assert_close(row_sum, whole[2], rtol=1e-5, atol=1e-6)
    with pytest.raises(ref.DocumentedMisuse):
        ref.npu_ring_attention_update(*first[:3], *second[:3], input_layout="BSH")


# ---- npu_grouped_matmul, npu_rms_norm, npu_swiglu, npu_rotary_mul --------------------------------------------------


def test_grouped_matmul_groups_rows_by_sizes_or_cumsum_and_the_k_axis():
    x, counts = _randn(7, 5, seed=27), [2, 0, 5]
    weights = [_randn(5, 3, seed=30 + i) for i in range(3)]
    expected = torch.cat([x[:2] @ weights[0], x[2:2] @ weights[1], x[2:] @ weights[2]])
    sizes = ref.npu_grouped_matmul(
        [x], weights, group_list=torch.tensor(counts), split_item=2, group_type=0, group_list_type=1
    )
    cumsum = ref.npu_grouped_matmul([x], weights, group_list=torch.tensor([2, 2, 7]), split_item=3, group_type=0)
    torch.testing.assert_close(sizes[0], expected)
    torch.testing.assert_close(cumsum[0], expected)
    dy = _randn(7, 3, seed=33)
    k_split = ref.npu_grouped_matmul(
        [x.t()], [dy], group_list=torch.tensor(counts), split_item=3, group_type=2, group_list_type=1
    )[0]
    assert k_split.shape == (3, 5, 3)
    torch.testing.assert_close(k_split[2], x[2:].t() @ dy[2:])
    assert not k_split[1].any()
    with pytest.raises(ref.DocumentedMisuse, match="not of length 1"):  # "且长度不能为1"
        ref.npu_grouped_matmul(
            [x], weights[:1], group_list=torch.tensor([7]), split_item=2, group_type=0, group_list_type=1
        )
    with pytest.raises(ref.DocumentedMisuse, match="non-decreasing"):
        ref.npu_grouped_matmul([x], weights, group_list=torch.tensor([2, 1, 7]), split_item=2, group_type=0)


def test_rms_norm_returns_y_and_rstd_swiglu_and_rotary_their_formulas():
    x, gamma = _randn(3, 2, 8, seed=34), _randn(8, seed=35)
    y, rstd = ref.npu_rms_norm(x, gamma, epsilon=1e-5)
    torch.testing.assert_close(y, F.rms_norm(x, (8,), gamma, 1e-5), rtol=1e-5, atol=1e-6)
    assert rstd.shape == (3, 2, 1) and rstd.dtype == torch.float32  # the meta registration's shape
    torch.testing.assert_close(rstd, torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    h = _randn(4, 6, seed=36)
    torch.testing.assert_close(ref.npu_swiglu(h), F.silu(h[:, :3]) * h[:, 3:])
    torch.testing.assert_close(ref.npu_swiglu(h, dim=0), F.silu(h[:2]) * h[2:])
    t, angles = _randn(5, 2, 3, 8, seed=37), _randn(5, 1, 1, 8, seed=38)
    cos, sin = angles.cos(), angles.sin()
    half = torch.cat((-t[..., 4:], t[..., :4]), dim=-1)
    torch.testing.assert_close(ref.npu_rotary_mul(t, cos, sin), t * cos + half * sin)
    pairs = torch.stack((-t[..., 1::2], t[..., ::2]), dim=-1).flatten(-2)
    torch.testing.assert_close(ref.npu_rotary_mul(t, cos, sin, mode="interleave"), t * cos + pairs * sin)
    with pytest.raises(ref.DocumentedMisuse, match=r"\[-1, 1\]"):  # the angles instead of cos / sin
        ref.npu_rotary_mul(t, angles * 10, sin)
    with pytest.raises(ref.DocumentedMisuse, match="4-d"):
        ref.npu_rotary_mul(t[0], cos[0], sin[0])


# ---- the npu accelerator's calls over the references ---------------------------------------------------------------


@pytest.fixture
def npu_over_reference():
    from megatron_npu.accelerator.npu import NpuAccelerator

    accelerator = object.__new__(NpuAccelerator)  # no torch_npu to import: the reference module instead
    accelerator._torch_npu = ref.build_torch_npu()
    accelerator._npu = accelerator._torch_npu.npu
    return accelerator


@pytest.mark.parametrize("experts", [1, 3])
def test_the_grouped_gemm_seam_runs_any_number_of_local_experts_within_the_documented_group_list(
    npu_over_reference, experts
):
    """One local expert (num_experts == EP size) gives a one-group group_list, which CANN refuses as group sizes
    (group_list_type 1: "长度不能为1"); the accelerator passes the cumulative form, valid for any count."""
    kernel = npu_over_reference.fused_kernel("grouped_matmul")
    counts = [4, 0, 3][:experts] if experts > 1 else [5]
    x = _randn(sum(counts), 6, seed=40).requires_grad_()
    weights = [_randn(3, 6, seed=41 + i).requires_grad_() for i in range(experts)]
    y = kernel(x, weights, counts)
    expected = torch.cat([part @ w.t() for part, w in zip(torch.split(x, counts), weights, strict=True)])
    torch.testing.assert_close(y, expected)
    dy = _randn(*y.shape, seed=50)
    torch.testing.assert_close(
        torch.autograd.grad(y, (x, *weights), dy), torch.autograd.grad(expected, (x, *weights), dy)
    )


@pytest.mark.parametrize("case", ["causal", "document", "window", "mla_gqa"])
def test_the_flash_attention_seam_over_the_references_equals_the_torch_twin(npu_over_reference, case):
    """NpuAccelerator._fused_flash_attention's arguments (SBH, the mask's polarity, sparse_mode, the band) against
    ops/fused.py's torch twin, which runs on the cpu target, forward and backward."""
    from megatron_npu.ops import fused

    sq, b, n, g = 12, 2, 4, 2 if case == "mla_gqa" else 4
    hq, hv = (12, 8) if case == "mla_gqa" else (8, 8)
    q, k, v = _randn(sq, b, n, hq, seed=60), _randn(sq, b, g, hq, seed=61), _randn(sq, b, g, hv, seed=62)
    mask = None
    if case == "document":
        mask = torch.ones(b, 1, sq, sq).tril() < 0.5
        mask[0, 0, 5:, :5] = True
        mask[1, 0, 9:, :9] = True
    options = {"softmax_scale": 0.3, "attention_mask": mask, "window": (3, 0) if case == "window" else None}
    kernel = npu_over_reference.fused_kernel("flash_attention")
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    twin_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    got = kernel(*inputs, **options)
    expected = fused.flash_attention(*twin_inputs, **options)  # the cpu target: torch's scaled_dot_product_attention
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    dy = _randn(*got.shape, seed=63)
    torch.testing.assert_close(
        torch.autograd.grad(got, inputs, dy), torch.autograd.grad(expected, twin_inputs, dy), rtol=1e-4, atol=1e-5
    )


def test_the_context_parallel_blocks_over_the_references_equal_their_torch_twins(npu_over_reference):
    """attention_block / attention_block_grad / attention_merge (ops/attention_blocks.py's kernels) on the
    references against the twins the cpu target runs."""
    from megatron_npu.ops import attention_blocks as blocks

    s, b, n, g, d = 8, 2, 4, 2, 8
    q, k, v = _randn(s, b, n, d, seed=70), _randn(s, b, g, d, seed=71), _randn(s, b, g, d, seed=72)
    for causal in (True, False):
        got = npu_over_reference.fused_kernel("attention_block")(q, k, v, softmax_scale=0.3, causal=causal)
        expected = blocks.block_forward_twin(q, k, v, softmax_scale=0.3, causal=causal)
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1][..., :1], expected[1])
        torch.testing.assert_close(got[2][..., :1], expected[2], rtol=1e-5, atol=1e-6)
        dout = _randn(s, b, n, d, seed=73)
        grads = npu_over_reference.fused_kernel("attention_block_grad")(
            q, k, v, dout, got[0], got[1], got[2], softmax_scale=0.3, causal=causal
        )
        twin = blocks.block_backward_twin(q, k, v, dout, *expected, softmax_scale=0.3, causal=causal)
        torch.testing.assert_close(grads, twin, rtol=1e-4, atol=1e-5)
    merge = npu_over_reference.fused_kernel("attention_merge")
    first = npu_over_reference.fused_kernel("attention_block")(q, k[:3], v[:3], softmax_scale=0.3, causal=False)
    second = npu_over_reference.fused_kernel("attention_block")(q, k[3:], v[3:], softmax_scale=0.3, causal=False)
    whole = blocks.block_forward_twin(q, k, v, softmax_scale=0.3, causal=False)
    torch.testing.assert_close(merge(*first, *second)[0], whole[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("rows", "keys", "shift", "left", "right"), [(6, 6, 0, 2, 0), (4, 6, 3, 4, 0), (6, 4, -1, 2, 1)]
)
def test_a_window_cut_block_runs_sparse_mode_4_over_the_reference_as_the_twins_band(
    npu_over_reference, rows, keys, shift, left, right
):
    """A ring block the window cuts, queries at global qo + i and keys at ko + j (shift = qo - ko), as
    cp_ring crops it (every row keeps a key): the block kernel's sparse_mode 4 call (CANN's band, whose pre / next
    count from the bottom-right corner) equals the twin's band mask and megatron-core's window
    ko + j in [qo + i - left, qo + i + right], forward and backward, on non-square blocks too."""
    from megatron_npu.accelerator import npu
    from megatron_npu.ops import attention_blocks as blocks

    band = (left - shift, right + shift)  # relative to the block's top-left diagonal
    offset = torch.arange(keys)[None, :] - torch.arange(rows)[:, None] - shift  # global key - query position
    window_mask = (offset < -left) | (offset > right)
    assert torch.equal(blocks.band_mask(rows, keys, band), window_mask)
    assert not window_mask.all(dim=1).any()  # the ring's crop: no fully masked row
    mask, sparse_mode, pre, nxt = npu._block_sparsity(rows, keys, torch.device("cpu"), False, band)
    assert (sparse_mode, tuple(mask.shape)) == (4, (2048, 2048))
    assert torch.equal(~ref._kept(rows, keys, mask, sparse_mode, pre, nxt, torch.device("cpu")), window_mask)
    b, n, g, d = 2, 4, 2, 8
    q, k, v = _randn(rows, b, n, d, seed=80), _randn(keys, b, g, d, seed=81), _randn(keys, b, g, d, seed=82)
    got = npu_over_reference.fused_kernel("attention_block")(q, k, v, softmax_scale=0.3, causal=False, band=band)
    twin = blocks.block_forward_twin(q, k, v, softmax_scale=0.3, causal=False, band=band)
    torch.testing.assert_close(got[0], twin[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1][..., :1], twin[1])
    torch.testing.assert_close(got[2][..., :1], twin[2], rtol=1e-5, atol=1e-6)
    dout = _randn(rows, b, n, d, seed=83)
    grads = npu_over_reference.fused_kernel("attention_block_grad")(
        q, k, v, dout, *got, softmax_scale=0.3, causal=False, band=band
    )
    twin_grads = blocks.block_backward_twin(q, k, v, dout, *twin, softmax_scale=0.3, causal=False, band=band)
    torch.testing.assert_close(grads, twin_grads, rtol=1e-4, atol=1e-5)
