"""Ring attention (``--cp-comm-type p2p``): key/value blocks travel the context-parallel ring.

Rank ``r`` of a ring of ``P`` holds the chunks ``r`` and ``2P - 1 - r`` of the sequence (of
``2P`` equal chunks: megatron-core's ``get_batch_on_this_cp_rank`` order, which evens out the
causal work), for its queries and its keys/values alike. At step ``i`` it holds the key/value
chunks of rank ``src = (r - i) mod P`` and, while the next block is on its way (send/recv posted
before the compute), attends to it; with causal masking only three kinds of block remain:

- ``i == 0`` (own keys): causal over the local sequence (its two chunks are in order);
- ``src < r``: every local query sees the first key chunk ``src`` and none of ``2P - 1 - src``;
- ``src > r``: only the second query chunk ``2P - 1 - r`` sees keys, both of ``src``'s chunks.

Blocks above the diagonal are never computed. Partial results merge with the online-softmax rule
(attention_blocks.merge). The backward runs the ring again with the whole rows' statistics: each
rank adds its queries' share of dK/dV to an accumulator that travels with the block and reaches
the block's owner after ``P`` hops, while dQ stays local.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_npu.accelerator import get_accelerator
from megatron_npu.ops import attention_blocks as blocks


class Ring:
    """Send to the next rank and receive from the previous one, asynchronously."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        """Post the send of ``tensor`` to the next rank and the receive of the previous rank's;
        returns the receive buffer and the requests to wait on before reading it."""
        received = torch.empty_like(tensor)
        if get_accelerator().prefers_unbatched_p2p:
            # even ranks send first, odd ranks receive first: each send meets a posted receive
            send = lambda: dist.isend(tensor, self.next, group=self.group)  # noqa: E731
            recv = lambda: dist.irecv(received, self.prev, group=self.group)  # noqa: E731
            first, second = (send, recv) if self.rank % 2 == 0 else (recv, send)
            return received, [first(), second()]
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group),
            dist.P2POp(dist.irecv, received, self.prev, self.group),
        ]
        return received, dist.batch_isend_irecv(ops)


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def _step_kind(ring: Ring, step: int) -> str:
    """ "diagonal", "first_keys" (src < r: all queries x the first key chunk) or "second_queries"."""
    if step == 0:
        return "diagonal"
    src = (ring.rank - step) % ring.size
    return "first_keys" if src < ring.rank else "second_queries"


def ring_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ring: Ring, softmax_scale: float
) -> blocks.Stats:
    """(out [s, b, np, hn], softmax_max, softmax_sum) of this rank's queries over the whole ring."""
    half = query.shape[0] // 2
    kv = torch.stack((key, value))
    out = row_max = row_sum = None
    for step in range(ring.size):
        pending = ring.shift(kv) if step + 1 < ring.size else None
        kind = _step_kind(ring, step)
        if kind == "diagonal":
            out, row_max, row_sum = blocks.block_forward(query, kv[0], kv[1], softmax_scale=softmax_scale, causal=True)
        elif kind == "first_keys":
            part = blocks.block_forward(query, kv[0, :half], kv[1, :half], softmax_scale=softmax_scale, causal=False)
            out, row_max, row_sum = blocks.merge(out, row_max, row_sum, *part)
        else:
            part = blocks.block_forward(query[half:], kv[0], kv[1], softmax_scale=softmax_scale, causal=False)
            merged = blocks.merge(out[half:], row_max[:, :, half:], row_sum[:, :, half:], *part)
            out = torch.cat((out[:half], merged[0]))
            row_max = torch.cat((row_max[:, :, :half], merged[1]), dim=2)
            row_sum = torch.cat((row_sum[:, :, :half], merged[2]), dim=2)
        if pending is not None:
            _wait(pending[1])
            kv = pending[0]
    return out, row_max, row_sum


def _block_grads(
    kind: str, saved: tuple[torch.Tensor, ...], kv: torch.Tensor, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice, slice]:
    """dq, dk, dv of one step and the query rows / key rows they belong to."""
    query, dout, out, row_max, row_sum = saved
    half = query.shape[0] // 2
    rows = slice(half, None) if kind == "second_queries" else slice(None)
    keys = slice(None, half) if kind == "first_keys" else slice(None)
    dq, dk, dv = blocks.block_backward(
        query[rows],
        kv[0, keys],
        kv[1, keys],
        dout[rows],
        out[rows],
        row_max[:, :, rows],
        row_sum[:, :, rows],
        softmax_scale=softmax_scale,
        causal=kind == "diagonal",
    )
    return dq, dk, dv, rows, keys


def ring_backward(
    saved: tuple[torch.Tensor, ...], key: torch.Tensor, value: torch.Tensor, ring: Ring, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this rank's query, key and value."""
    query = saved[0]
    dq = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    kv = torch.stack((key, value))
    dkv_pending = None
    for step in range(ring.size):
        kv_pending = ring.shift(kv) if step + 1 < ring.size else None
        dq_part, dk, dv, rows, keys = _block_grads(_step_kind(ring, step), saved, kv, softmax_scale)
        dq[rows] += dq_part.float()
        if dkv_pending is None:
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        else:
            _wait(dkv_pending[1])
            dkv = dkv_pending[0]
        dkv[0, keys] += dk.float()
        dkv[1, keys] += dv.float()
        # the accumulator follows its block: after P hops it is back with the block's owner
        dkv_pending = ring.shift(dkv) if ring.size > 1 else (dkv, [])
        if kv_pending is not None:
            _wait(kv_pending[1])
            kv = kv_pending[0]
    _wait(dkv_pending[1])
    dkv = dkv_pending[0]
    return dq.to(query.dtype), dkv[0].to(key.dtype), dkv[1].to(value.dtype)


class RingAttention(torch.autograd.Function):
    """Causal attention of the load-balanced local sequence over the whole ring, with its backward."""

    @staticmethod
    def forward(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ring: Ring, softmax_scale: float
    ) -> torch.Tensor:
        out, row_max, row_sum = ring_forward(query, key, value, ring, softmax_scale)
        ctx.ring, ctx.softmax_scale = ring, softmax_scale
        ctx.save_for_backward(query, key, value, out, row_max, row_sum)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> Any:
        query, key, value, out, row_max, row_sum = ctx.saved_tensors
        saved = (query, dout.contiguous(), out, row_max, row_sum)
        dq, dk, dv = ring_backward(saved, key, value, ctx.ring, ctx.softmax_scale)
        return dq, dk, dv, None, None
