"""Context parallelism without Transformer Engine (megatron_npu/ops/context_parallel.py).

ContextParallelAttention on each rank's load-balanced share of the sequence (megatron-core's
get_batch_on_this_cp_rank) must give the outputs and the query/key/value gradients of megatron-core's
DotProductAttention over the whole sequence at CP1 (fp32, rel 1e-6), causal, GQA and multi-latent attention's
wider query/key than value heads included, gpt-oss's attention (a sliding-window layer and a full layer of
--window-size 4,0 --window-attn-skip-freq 2, with --softmax-type learnable sinks and their gradient), for p2p (ring),
a2a (Ulysses) and a2a+p2p (hierarchical), with TP, and per-layer comm types; the bytes
each rank sends, forward and backward, are the planner's (megatron_npu/layout/cp_comm.py).
"""

from __future__ import annotations

import pytest
import torch
from distributed import ROOT, torchrun

from megatron_npu.ops import attention_blocks, cp_ring

WORKER = ROOT / "tests" / "fixtures" / "cp_attention_worker.py"
TOLERANCE = 1e-6


def _check_cases(job, expected_cases: dict[str, str]) -> dict:
    results = job.check().by_rank()
    first = results[0]
    # errors are all-reduced
    assert all([c["errors"] for c in r["cases"]] == [c["errors"] for c in first["cases"]] for r in results.values())
    assert {case["case"]: case["used"] for case in first["cases"]} == expected_cases
    for case in first["cases"]:
        # out, dq, dk, dv (and the sinks' gradient)
        assert len(case["errors"]) == (5 if "sinks" in case["case"] else 4), case
        assert max(case["errors"]) < TOLERANCE, case
    for result in results.values():
        for case in result["cases"]:
            # what each rank sent is what megatron_npu/layout/cp_comm.py plans for the layer
            assert case["sent"] == case["planned"], case
    return first


@pytest.mark.launch
def test_two_ranks_ring_and_ulysses_with_ascend_shaped_statistics():
    """CP2: ring with MHA, GQA and MLA's head sizes, Ulysses, a per-layer list; kernels that return Ascend's
    8-wide softmax statistics (npu_fusion_attention's layout) through the accelerator seam."""
    cases = {
        "p2p:1:2:4:4": "p2p",
        "p2p:1:2:4:2": "p2p",
        "a2a:1:2:4:2": "a2a",
        "p2p,a2a:1:2:4:2": "a2a",
        "p2p:1:2:4:4:mla": "p2p",
        "a2a:1:2:4:4:mla": "a2a",
        # gpt-oss: a window layer (blocks cut by the window run the kernels as their band) and a full one
        "p2p:1:2:4:2:win:sinks": "p2p",
        "p2p:1:2:4:2:full:sinks": "p2p",
        "a2a:1:2:4:2:win:sinks": "a2a",
        "a2a:1:2:4:2:full:sinks": "a2a",
    }
    job = torchrun(WORKER, "--wide-stats", *cases, "refuse=a2a:2:4:1", "refuse=all_gather:2:4:4", nproc=2)
    first = _check_cases(job, cases)
    # the window layer's cut blocks reach the kernels as their band (sparse_mode 4 on Ascend), forward and backward
    kernels = {"attention_block", "attention_block_grad", "attention_merge"}
    assert set(first["kernel_calls"]) == kernels | {"attention_block band", "attention_block_grad band"}
    heads, unknown = first["refused"]
    assert "query groups (1) per tensor-parallel rank divisible by 2" in heads and "--cp-comm-type p2p" in heads
    assert unknown.startswith("--cp-comm-type all_gather is not available without Transformer Engine")


@pytest.mark.launch
def test_four_ranks_ring_ulysses_hierarchical_and_tensor_parallel():
    cases = {
        "p2p:1:4:4:2": "p2p",
        "a2a:1:4:8:4": "a2a",
        "a2a+p2p:1:4:4:2:2": "a2a+p2p",
        "p2p:2:2:4:2": "p2p",
        "a2a:2:2:8:4": "a2a",
        "p2p:1:2:4:1": "p2p",  # CP2 x DP2, multi-query
        "a2a+p2p:1:4:4:4:2:mla": "a2a+p2p",
        "p2p:2:2:4:4:mla": "p2p",
        # gpt-oss's window layer with sinks: CP4 (whole ring steps outside the window), TP2 x CP2, hierarchical
        "p2p:1:4:4:2:win:sinks": "p2p",
        "p2p:2:2:4:2:win:sinks": "p2p",
        "a2a+p2p:1:4:4:2:2:win:sinks": "a2a+p2p",
    }
    job = torchrun(WORKER, *cases, "refuse=a2a+p2p:4:4:4", nproc=4)
    first = _check_cases(job, cases)
    assert first["refused"] == [
        "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes with two sizes (a2a p2p)"
    ]


def test_block_twin_and_merge_equal_softmax_attention_over_the_whole_row():
    """Two key blocks attended separately and merged by the online-softmax rule equal one softmax over
    all keys (the same for the causal diagonal alone); GQA by repeated groups."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(6, 2, 4, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(12, 2, 2, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    scale = 0.3
    first = attention_blocks.block_forward(q, k[:6], v[:6], softmax_scale=scale, causal=False)
    second = attention_blocks.block_forward(q, k[6:], v[6:], softmax_scale=scale, causal=False)
    merged, _, _ = attention_blocks.merge(*first, *second)
    expand = lambda t: t.repeat_interleave(2, dim=2).permute(1, 2, 0, 3)  # noqa: E731
    probs = torch.softmax(torch.matmul(q.permute(1, 2, 0, 3), expand(k).transpose(-1, -2)) * scale, dim=-1)
    torch.testing.assert_close(merged, torch.matmul(probs, expand(v)).permute(2, 0, 1, 3), rtol=0, atol=1e-12)
    causal, _, _ = attention_blocks.block_forward(q, k[:6], v[:6], softmax_scale=scale, causal=True)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), expand(k[:6]), expand(v[:6]), is_causal=True, scale=scale
    )
    torch.testing.assert_close(causal, reference.permute(2, 0, 1, 3), rtol=0, atol=1e-12)


def _global_visible(length: int, window: tuple[int, int] | None) -> torch.Tensor:
    offset = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    visible = offset <= (0 if window is None else window[1])
    return visible & (offset >= -window[0]) if window is not None else visible


@pytest.mark.parametrize("window", [None, (4, 0), (9, 0), (2, 1), (1, 0)])
@pytest.mark.parametrize("size", [2, 4])
def test_ring_steps_attend_exactly_the_global_mask_and_skip_masked_blocks(size, window):
    """Over the ring's steps, each rank's pieces cover exactly the (query, key) pairs megatron-core's causal or
    sliding-window mask lets attend (global positions of the load-balanced chunks), once each; no piece is
    computed where all is masked; a window's cut is a band; without a window the steps are the three causal
    kinds."""
    chunk = 3
    length = 2 * chunk
    whole = _global_visible(2 * size * chunk, window)
    for rank in range(size):
        queries = cp_ring._positions(rank, size, length)
        covered = torch.zeros(2 * size * chunk, 2 * size * chunk, dtype=torch.int64)
        for step in range(size):
            keys = cp_ring._positions((rank - step) % size, size, length)
            for piece in cp_ring.step_pieces(rank, size, step, length, window):
                seen = torch.ones(
                    piece.rows.stop - piece.rows.start, piece.keys.stop - piece.keys.start, dtype=torch.bool
                )
                if piece.causal:
                    seen = seen.tril()
                # a cut is a band around the block's diagonal, which the device's block kernel takes
                if piece.band is not None:
                    seen = ~attention_blocks.band_mask(*seen.shape, piece.band)
                assert seen.any(dim=1).all(), (rank, step, piece)  # every computed row sees a key
                q, k = queries[piece.rows], keys[piece.keys]
                covered[q[:, None], k[None, :]] += seen.long()
                if window is None:
                    src = (rank - step) % size
                    expected = {0: (slice(0, 6), slice(0, 6), True)}.get(
                        step, (slice(0, 6), slice(0, 3), False) if src < rank else (slice(3, 6), slice(0, 6), False)
                    )
                    assert (piece.rows, piece.keys, piece.causal, piece.band) == (*expected, None)
        assert torch.equal(covered[queries], whole[queries].long()), (rank, window)


@pytest.mark.parametrize("window", [None, (2, 0)])
def test_one_rank_ring_with_sinks_equals_softmax_over_scores_and_sinks(window):
    """A ring of one (the a2a path's) with sinks: megatron-core's SoftmaxOne (softmax over [scores, sink] with the
    sink's column dropped), output and the gradients of q, k, v and the sinks (fp64 inputs, autograd of the
    reference; the ring accumulates dq / dk / dv in fp32, so rel 1e-6 as the CP cases)."""
    generator = torch.Generator().manual_seed(4)
    s, heads, groups, scale = 8, 4, 2, 0.4
    q = torch.randn(s, 2, heads, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(s, 2, groups, 8, generator=generator, dtype=torch.float64, requires_grad=True) for _ in "kv")
    sinks = torch.randn(heads, generator=generator, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(s, 2, heads, 8, generator=generator, dtype=torch.float64)
    out = cp_ring.RingAttention.apply(q, k, v, sinks, cp_ring.Ring(None), scale, window)
    got = [out, *torch.autograd.grad(out, (q, k, v, sinks), dout)]
    expand = lambda t: t.repeat_interleave(heads // groups, dim=2).permute(1, 2, 0, 3)  # noqa: E731
    scores = torch.matmul(q.permute(1, 2, 0, 3), expand(k).transpose(-1, -2)) * scale
    masked = ~_global_visible(s, window)
    scores = scores.masked_fill(masked, float("-inf"))
    with_sink = torch.cat((scores, sinks.view(1, -1, 1, 1).expand(2, -1, s, 1)), dim=-1)
    probs = torch.softmax(with_sink, dim=-1)[..., :-1]
    want_out = torch.matmul(probs, expand(v)).permute(2, 0, 1, 3)
    want = [want_out, *torch.autograd.grad(want_out, (q, k, v, sinks), dout)]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and ((g - w).abs().max() / w.abs().max()).item() < TOLERANCE
