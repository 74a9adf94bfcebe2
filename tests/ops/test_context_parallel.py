"""Context parallelism without Transformer Engine (megatron_npu/ops/context_parallel.py).

ContextParallelAttention on each rank's load-balanced share of the sequence (megatron-core's
get_batch_on_this_cp_rank) must give the outputs and the query/key/value gradients of megatron-core's
DotProductAttention over the whole sequence at CP1 (fp32, rel 1e-6), causal, GQA and multi-latent attention's
wider query/key than value heads included, for p2p (ring), a2a (Ulysses) and a2a+p2p (hierarchical), with TP,
and per-layer comm types; the bytes
each rank sends, forward and backward, are the planner's (megatron_npu/layout/cp_comm.py).
"""

from __future__ import annotations

import pytest
import torch
from distributed import ROOT, torchrun

from megatron_npu.ops import attention_blocks

WORKER = ROOT / "tests" / "fixtures" / "cp_attention_worker.py"
TOLERANCE = 1e-6


def _check_cases(job, expected_cases: dict[str, str]) -> dict:
    results = job.check().by_rank()
    first = results[0]
    # errors are all-reduced
    assert all([c["errors"] for c in r["cases"]] == [c["errors"] for c in first["cases"]] for r in results.values())
    assert {case["case"]: case["used"] for case in first["cases"]} == expected_cases
    for case in first["cases"]:
        # out, dq, dk, dv
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
    }
    job = torchrun(WORKER, "--wide-stats", *cases, "refuse=a2a:2:4:1", "refuse=all_gather:2:4:4", nproc=2)
    first = _check_cases(job, cases)
    assert set(first["kernel_calls"]) == {"attention_block", "attention_block_grad", "attention_merge"}
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
