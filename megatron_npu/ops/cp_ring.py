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

Keys and values travel side by side on the last dimension (``[s, b, ng, dk + dv]``), so their head
sizes may differ (multi-latent attention: q/k ``qk_head_dim + qk_pos_emb_head_dim``, v ``v_head_dim``)
and the ring moves exactly their elements. attention_blocks' kernels take one head size (the device's
fused attention is called with one D, as ``--use-flash-attn``'s MLA path pads it): each block widens
q, k and v with zero channels to the larger size, which adds zeros to the scores and to the output's
extra channels; those channels are cut off the output and the gradients.
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


class HeadSizes:
    """Key and value head sizes of one ring, and the one width the blocks run at (the larger)."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.key, self.value = key.shape[-1], value.shape[-1]
        self.width = max(self.key, self.value)

    def pack(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """K and V as the one tensor that travels: [s, b, ng, dk + dv]."""
        return torch.cat((key, value), dim=-1)

    def widen(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` with zero channels up to the blocks' width (itself where it has it)."""
        missing = self.width - tensor.shape[-1]
        return torch.nn.functional.pad(tensor, (0, missing)) if missing else tensor

    def block(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One travelling block's key and value at the blocks' width."""
        return self.widen(kv[..., : self.key]), self.widen(kv[..., self.key :])


def ring_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ring: Ring, softmax_scale: float
) -> blocks.Stats:
    """(out [s, b, np, dv], softmax_max, softmax_sum) of this rank's queries over the whole ring."""
    sizes = HeadSizes(key, value)
    query = sizes.widen(query)
    half = query.shape[0] // 2
    kv = sizes.pack(key, value)
    out = row_max = row_sum = None
    for step in range(ring.size):
        pending = ring.shift(kv) if step + 1 < ring.size else None
        kind = _step_kind(ring, step)
        k, v = sizes.block(kv)
        if kind == "diagonal":
            out, row_max, row_sum = blocks.block_forward(query, k, v, softmax_scale=softmax_scale, causal=True)
        elif kind == "first_keys":
            part = blocks.block_forward(query, k[:half], v[:half], softmax_scale=softmax_scale, causal=False)
            out, row_max, row_sum = blocks.merge(out, row_max, row_sum, *part)
        else:
            part = blocks.block_forward(query[half:], k, v, softmax_scale=softmax_scale, causal=False)
            merged = blocks.merge(out[half:], row_max[:, :, half:], row_sum[:, :, half:], *part)
            out = torch.cat((out[:half], merged[0]))
            row_max = torch.cat((row_max[:, :, :half], merged[1]), dim=2)
            row_sum = torch.cat((row_sum[:, :, :half], merged[2]), dim=2)
        if pending is not None:
            _wait(pending[1])
            kv = pending[0]
    return out[..., : sizes.value], row_max, row_sum


def _block_grads(
    kind: str, saved: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice, slice]:
    """dq, dk, dv of one step (at the blocks' width) and the query rows / key rows they belong to."""
    query, dout, out, row_max, row_sum = saved
    half = query.shape[0] // 2
    rows = slice(half, None) if kind == "second_queries" else slice(None)
    keys = slice(None, half) if kind == "first_keys" else slice(None)
    dq, dk, dv = blocks.block_backward(
        query[rows],
        k[keys],
        v[keys],
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
    sizes = HeadSizes(key, value)
    query, dout, out, row_max, row_sum = saved
    # the blocks' width: out and dout's zero channels leave the row sums of dout * out as they are
    saved = (sizes.widen(query), sizes.widen(dout), sizes.widen(out), row_max, row_sum)
    dq = torch.zeros(saved[0].shape, dtype=torch.float32, device=query.device)
    kv = sizes.pack(key, value)
    dkv_pending = None
    for step in range(ring.size):
        kv_pending = ring.shift(kv) if step + 1 < ring.size else None
        dq_part, dk, dv, rows, keys = _block_grads(_step_kind(ring, step), saved, *sizes.block(kv), softmax_scale)
        dq[rows] += dq_part.float()
        if dkv_pending is None:
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        else:
            _wait(dkv_pending[1])
            dkv = dkv_pending[0]
        dkv[keys, ..., : sizes.key] += dk[..., : sizes.key].float()
        dkv[keys, ..., sizes.key :] += dv[..., : sizes.value].float()
        # the accumulator follows its block: after P hops it is back with the block's owner
        dkv_pending = ring.shift(dkv) if ring.size > 1 else (dkv, [])
        if kv_pending is not None:
            _wait(kv_pending[1])
            kv = kv_pending[0]
    _wait(dkv_pending[1])
    dkv = dkv_pending[0]
    dq, dk, dv = dq[..., : sizes.key], dkv[..., : sizes.key], dkv[..., sizes.key :]
    return dq.to(query.dtype).contiguous(), dk.to(key.dtype).contiguous(), dv.to(value.dtype).contiguous()


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
