"""Attention on one (query block, key/value block) pair with its softmax statistics, and their merge.

The pieces context parallelism is built from (megatron_npu/ops/context_parallel.py): a block's
output comes with the row max and the row sum of ``exp(score - max)`` (``softmax_max`` /
``softmax_sum``, fp32, ``[b, np, sq, k]``), so that blocks over different keys merge exactly with
the online-softmax rule, and the backward of a block takes the statistics of the whole row.

Each function runs the accelerator's kernel where the device has one (``fused_kernel``:
``"attention_block"``, ``"attention_block_grad"``, ``"attention_merge"``; on Ascend
``npu_fusion_attention``, ``npu_fusion_attention_grad``, ``npu_ring_attention_update``) and
otherwise the torch twin here, with the same outputs. The statistics' last dimension ``k`` is the
device's (Ascend repeats each value 8 times, the twin keeps 1): callers treat it as opaque and
everything here broadcasts over it.

Layouts: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` with ``ng | np`` (GQA: query
head ``h`` reads group ``h // (np / ng)``, as megatron-core's ``repeat_interleave``).
``causal`` masks the keys after each query (``sq == sk``, the diagonal block). ``band`` ``(pre, next)`` is a block
a sliding window cuts (context parallelism's windows, from global token positions): key ``j`` is seen by query
``i`` iff ``i - pre <= j <= i + next`` (block-local indices, relative to the top-left diagonal; every row keeps at
least one key); the device's block kernels take it (on Ascend sparse_mode 4).
"""

from __future__ import annotations

import torch

from megatron_npu.accelerator import get_accelerator

Stats = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _wide(t: torch.Tensor) -> torch.Tensor:
    """The twin's compute precision: fp32 for 16-bit inputs (as the kernels accumulate), else the input's."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def band_mask(sq: int, sk: int, band: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
    """[sq, sk] bool, True = masked: the keys outside ``i - pre <= j <= i + next`` (band = (pre, next))."""
    offset = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None]  # j - i
    return (offset < -band[0]) | (offset > band[1])


def _scores(
    query: torch.Tensor,
    key: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    band: tuple[int, int] | None = None,
) -> torch.Tensor:
    """fp32 scaled scores [b, np, sq, sk] with the key groups repeated to the query heads."""
    groups = query.shape[2] // key.shape[2]
    q = _wide(query).permute(1, 2, 0, 3)
    k = _wide(key).repeat_interleave(groups, dim=2).permute(1, 2, 3, 0)
    scores = torch.matmul(q, k) * softmax_scale
    if causal:
        sq, sk = scores.shape[-2:]
        above = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(diagonal=1)
        scores = scores.masked_fill(above, float("-inf"))
    if band is not None:
        scores = scores.masked_fill(band_mask(*scores.shape[-2:], band, scores.device), float("-inf"))
    return scores


def _values(value: torch.Tensor, heads: int) -> torch.Tensor:
    """fp32 values [b, np, sk, hn] with the groups repeated to the query heads."""
    return _wide(value).repeat_interleave(heads // value.shape[2], dim=2).permute(1, 2, 0, 3)


def block_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    band: tuple[int, int] | None = None,
) -> Stats:
    """(out [sq, b, np, hn] in query's dtype, softmax_max, softmax_sum) of one block."""
    kernel = get_accelerator().fused_kernel("attention_block")
    if kernel is not None:
        return kernel(query, key, value, softmax_scale=softmax_scale, causal=causal, band=band)
    return block_forward_twin(query, key, value, softmax_scale=softmax_scale, causal=causal, band=band)


def block_forward_twin(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    band: tuple[int, int] | None = None,
) -> Stats:
    scores = _scores(query, key, softmax_scale, causal, band)
    row_max = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights / row_sum, _values(value, query.shape[2]))
    return out.permute(2, 0, 1, 3).to(query.dtype), row_max, row_sum


def block_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    softmax_max: torch.Tensor,
    softmax_sum: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    band: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given the whole row's statistics and output (flash attention's
    backward: the probabilities are rebuilt from the scores and the row's max and sum)."""
    kernel = get_accelerator().fused_kernel("attention_block_grad")
    stats = (out, softmax_max, softmax_sum)
    if kernel is not None:
        return kernel(query, key, value, dout, *stats, softmax_scale=softmax_scale, causal=causal, band=band)
    return block_backward_twin(query, key, value, dout, *stats, softmax_scale=softmax_scale, causal=causal, band=band)


def block_backward_twin(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    softmax_max: torch.Tensor,
    softmax_sum: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    band: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, groups = query.shape[2], key.shape[2]
    scores = _scores(query, key, softmax_scale, causal, band)
    probs = torch.exp(scores - softmax_max[..., :1]) / softmax_sum[..., :1]
    d_out = _wide(dout).permute(1, 2, 0, 3)  # [b, np, sq, hn]
    dv = torch.matmul(probs.transpose(-1, -2), d_out)  # [b, np, sk, hn]
    d_probs = torch.matmul(d_out, _values(value, heads).transpose(-1, -2))
    row_dot = (d_out * _wide(out).permute(1, 2, 0, 3)).sum(dim=-1, keepdim=True)
    d_scores = probs * (d_probs - row_dot) * softmax_scale
    k = _wide(key).repeat_interleave(heads // groups, dim=2).permute(1, 2, 0, 3)
    dq = torch.matmul(d_scores, k)
    dk = torch.matmul(d_scores.transpose(-1, -2), _wide(query).permute(1, 2, 0, 3))
    return dq.permute(2, 0, 1, 3).to(query.dtype), _to_groups(dk, groups, key.dtype), _to_groups(dv, groups, key.dtype)


def _to_groups(grad: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """[b, np, sk, hn] per query head -> [sk, b, ng, hn] summed over the heads of each group."""
    b, heads, sk, hn = grad.shape
    return grad.view(b, groups, heads // groups, sk, hn).sum(dim=2).permute(2, 0, 1, 3).to(dtype)


def merge(
    out: torch.Tensor,
    softmax_max: torch.Tensor,
    softmax_sum: torch.Tensor,
    block_out: torch.Tensor,
    block_max: torch.Tensor,
    block_sum: torch.Tensor,
) -> Stats:
    """Two partial results over disjoint keys of the same queries, merged (online softmax):
    the new max, both sums rescaled to it, the outputs weighted by their share of the new sum."""
    kernel = get_accelerator().fused_kernel("attention_merge")
    if kernel is not None:
        return kernel(out, softmax_max, softmax_sum, block_out, block_max, block_sum)
    return merge_twin(out, softmax_max, softmax_sum, block_out, block_max, block_sum)


def merge_twin(
    out: torch.Tensor,
    softmax_max: torch.Tensor,
    softmax_sum: torch.Tensor,
    block_out: torch.Tensor,
    block_max: torch.Tensor,
    block_sum: torch.Tensor,
) -> Stats:
    new_max = torch.maximum(softmax_max, block_max)
    old_part = softmax_sum * torch.exp(softmax_max - new_max)
    new_part = block_sum * torch.exp(block_max - new_max)
    new_sum = old_part + new_part
    # [b, np, sq, 1] -> [sq, b, np, 1], the outputs' layout
    old_weight = (old_part / new_sum)[..., :1].permute(2, 0, 1, 3)
    new_weight = (new_part / new_sum)[..., :1].permute(2, 0, 1, 3)
    merged = _wide(out) * old_weight + _wide(block_out) * new_weight
    return merged.to(out.dtype), new_max, new_sum
