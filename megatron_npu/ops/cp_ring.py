"""Ring attention (``--cp-comm-type p2p``): key/value blocks travel the context-parallel ring.

Rank ``r`` of a ring of ``P`` holds the chunks ``r`` and ``2P - 1 - r`` of the sequence (of
``2P`` equal chunks: megatron-core's ``get_batch_on_this_cp_rank`` order, which evens out the
causal work), for its queries and its keys/values alike. At step ``i`` it holds the key/value
chunks of rank ``src = (r - i) mod P`` and, while the next block is on its way (send/recv posted
before the compute), attends to it. Which query rows see which keys follows from the global token
positions (``step_pieces``); with causal masking only three kinds of block remain:

- ``i == 0`` (own keys): causal over the local sequence (its two chunks are in order);
- ``src < r``: every local query sees the first key chunk ``src`` and none of ``2P - 1 - src``;
- ``src > r``: only the second query chunk ``2P - 1 - r`` sees keys, both of ``src``'s chunks.

A sliding window (``--window-size left,right``: query i sees keys ``i - left .. i + right``) leaves each
step a run of rows per query chunk that sees a run of keys: fully visible, causal, or cut by the window (a band
around the block's diagonal from the global positions, which the device's block kernel takes: a step whose cut is
no band is split into one block per query chunk x key chunk); fully masked blocks are skipped. Blocks above the diagonal are never
computed. Partial results merge with the online-softmax rule (attention_blocks.merge); attention sinks
(megatron-core's ``softmax_offset``, one logit per head added to each row's softmax denominator) are one more
merge at the end, a key of that logit and value 0, once per query row. The backward runs the ring again with the
whole rows' statistics (the sinks' term included: their key's value 0 leaves the blocks' backward as it is, and
the sinks' gradient is ``-sum p_sink (dout . out)`` over their rows): each rank adds its queries' share of dK/dV
to an accumulator that travels with the block and reaches the block's owner after ``P`` hops, while dQ stays
local.

Keys and values travel side by side on the last dimension (``[s, b, ng, dk + dv]``), so their head
sizes may differ (multi-latent attention: q/k ``qk_head_dim + qk_pos_emb_head_dim``, v ``v_head_dim``)
and the ring moves exactly their elements. attention_blocks' kernels take one head size (the device's
fused attention is called with one D, as ``--use-flash-attn``'s MLA path pads it): each block widens
q, k and v with zero channels to the larger size, which adds zeros to the scores and to the output's
extra channels; those channels are cut off the output and the gradients.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Piece:
    """One block a step computes: local query rows x rows of the travelling key/value block, with its mask
    (``causal``: the square causal triangle; ``band``: (pre, next), where a sliding window cuts the block along
    its diagonal, as attention_blocks takes it; neither: every key)."""

    rows: slice
    keys: slice
    causal: bool = False
    band: tuple[int, int] | None = None


def _positions(rank: int, size: int, length: int) -> torch.Tensor:
    """Global token positions of a rank's ``length`` local rows: chunks ``rank`` and ``2 * size - 1 - rank``."""
    half = length // 2
    offsets = torch.arange(half)
    return torch.cat((rank * half + offsets, (2 * size - 1 - rank) * half + offsets))


def _span(flags: torch.Tensor) -> slice | None:
    """The rows where ``flags`` holds as a slice; None where it holds nowhere or not on one contiguous run."""
    where = flags.nonzero().flatten().tolist()
    if not where or where[-1] - where[0] + 1 != len(where):
        return None
    return slice(where[0], where[-1] + 1)


def _piece(visible: torch.Tensor, first_row: int) -> Piece | None:
    """The one block covering what ``visible`` ([rows, keys], rows from ``first_row``) lets attend; None where
    its visible rows or keys are not one contiguous run each, or what they see is no band."""
    rows, keys = _span(visible.any(dim=1)), _span(visible.any(dim=0))
    if rows is None or keys is None:
        return None
    seen = visible[rows, keys]
    rows = slice(rows.start + first_row, rows.stop + first_row)
    if bool(seen.all()):
        return Piece(rows, keys)
    if seen.shape[0] == seen.shape[1] and torch.equal(seen, torch.ones_like(seen).tril()):
        return Piece(rows, keys, causal=True)
    band = _band_of(seen)
    return Piece(rows, keys, band=band) if band is not None else None


def _band_of(seen: torch.Tensor) -> tuple[int, int] | None:
    """(pre, next) with ``seen`` ([rows, keys], True = seen) exactly the keys ``i - pre <= j <= i + next``; None where
    it is no such band. For rows at global positions qo + i and keys at ko + j, megatron-core's window
    ``i - left <= j <= i + right`` gives pre = left - (qo - ko), next = right + (qo - ko): a band whenever the rows
    and the keys are each one run of consecutive positions (one chunk's)."""
    offset = torch.arange(seen.shape[1])[None, :] - torch.arange(seen.shape[0])[:, None]  # j - i
    pre, nxt = -int(offset[seen].min()), int(offset[seen].max())
    return (pre, nxt) if torch.equal(seen, (offset >= -pre) & (offset <= nxt)) else None


@functools.lru_cache(maxsize=1024)
def step_pieces(rank: int, size: int, step: int, length: int, window: tuple[int, int] | None) -> tuple[Piece, ...]:
    """The blocks of one ring step, from the global positions of this rank's queries and the step's keys
    (those of rank ``(rank - step) mod size``): query i sees key j where ``j <= i`` (causal) or, with a
    sliding window (left, right), ``i - left <= j <= i + right`` (megatron-core's sliding-window mask).
    Fully masked blocks are skipped: a step whose keys no query sees has no piece. Without a window this is
    the causal diagonal at step 0, then all queries x the first key chunk (src < rank) or the second query
    chunk x all keys (src > rank)."""
    src = (rank - step) % size
    offset = _positions(src, size, length)[None, :] - _positions(rank, size, length)[:, None]  # j - i
    visible = offset <= (0 if window is None else window[1])
    if window is not None:
        visible &= offset >= -window[0]
    if not bool(visible.any()):
        return ()
    whole = _piece(visible, 0)
    if whole is not None:
        pieces: tuple[Piece, ...] = (whole,)
    else:
        # a window cuts within chunks: one block per (query chunk, key chunk), each a band (its rows and its keys
        # are runs of consecutive positions), the diagonal ones first (they hold every row of their chunk at step 0)
        half = length // 2
        quadrants = [(q, kv) for q in (0, 1) for kv in (q, 1 - q)]
        pieces = tuple(p for q, kv in quadrants if (p := _quadrant(visible, q, kv, half)) is not None)
    if step == 0 and {row for p in pieces for row in range(p.rows.start, p.rows.stop)} != set(range(length)):
        raise ValueError(f"context-parallel attention needs every token to see itself; the window is {window}")
    return pieces


def _quadrant(visible: torch.Tensor, rows_half: int, keys_half: int, half: int) -> Piece | None:
    """The block of one query chunk x one key chunk (None where no query of it sees a key of it)."""
    part = visible[rows_half * half : (rows_half + 1) * half, keys_half * half : (keys_half + 1) * half]
    if not bool(part.any()):
        return None
    piece = _piece(part, rows_half * half)
    if piece is None:  # consecutive positions under megatron-core's window always give a band
        raise ValueError(f"context-parallel attention cannot cut {part.int().tolist()} into a band")
    keys = slice(piece.keys.start + keys_half * half, piece.keys.stop + keys_half * half)
    return Piece(piece.rows, keys, piece.causal, piece.band)


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


class Accumulator:
    """The merged (out, softmax_max, softmax_sum) of all local query rows, block by block. The statistics'
    last dimension is the device's (opaque): a block from a kernel and one from the torch twin may differ in
    it, so both are broadcast to the wider."""

    def __init__(self) -> None:
        self.stats: list[torch.Tensor] | None = None

    def _width(self, part: blocks.Stats) -> blocks.Stats:
        out, block_max, block_sum = part
        width = max(self.stats[1].shape[-1], block_max.shape[-1])
        if self.stats[1].shape[-1] < width:
            self.stats[1:] = [t.expand(*t.shape[:-1], width).contiguous() for t in self.stats[1:]]
        return out, block_max.expand(*block_max.shape[:-1], width), block_sum.expand(*block_sum.shape[:-1], width)

    def add(self, rows: slice, part: blocks.Stats, length: int, first: bool) -> None:
        """``part`` for the rows ``rows``: their first block (set) or a later one (merged)."""
        if self.stats is None:
            if rows == slice(0, length):
                self.stats = [t.contiguous() for t in part]  # written row by row below
                return
            out, row_max, row_sum = part
            self.stats = [
                out.new_empty((length, *out.shape[1:])),
                row_max.new_empty((*row_max.shape[:2], length, row_max.shape[-1])),
                row_sum.new_empty((*row_sum.shape[:2], length, row_sum.shape[-1])),
            ]
        out, block_max, block_sum = self._width(part)
        if not first:
            out, block_max, block_sum = blocks.merge(
                self.stats[0][rows], self.stats[1][:, :, rows], self.stats[2][:, :, rows], out, block_max, block_sum
            )
        self.stats[0][rows] = out
        self.stats[1][:, :, rows] = block_max
        self.stats[2][:, :, rows] = block_sum

    def add_sinks(self, sinks: torch.Tensor) -> None:
        """The sinks' term, once per query row: a key of logit ``sinks[h]`` and value 0 (megatron-core's
        softmax_offset: softmax over [scores, sink] with the sink's column dropped)."""
        out, row_max, row_sum = self.stats
        sink_max = sinks.to(row_max.dtype).view(1, -1, 1, 1).expand(row_max.shape)
        self.stats = list(
            blocks.merge(out, row_max, row_sum, torch.zeros_like(out), sink_max, torch.ones_like(row_sum))
        )


def ring_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ring: Ring,
    softmax_scale: float,
    window: tuple[int, int] | None = None,
    sinks: torch.Tensor | None = None,
) -> blocks.Stats:
    """(out [s, b, np, dv], softmax_max, softmax_sum) of this rank's queries over the whole ring (the sinks'
    term included in the statistics)."""
    sizes = HeadSizes(key, value)
    query = sizes.widen(query)
    length = query.shape[0]
    kv = sizes.pack(key, value)
    merged = Accumulator()
    covered = [False] * length  # rows with a block merged (step 0 covers them all, its diagonal blocks first)
    for step in range(ring.size):
        pending = ring.shift(kv) if step + 1 < ring.size else None
        k, v = sizes.block(kv)
        for piece in step_pieces(ring.rank, ring.size, step, length, window):
            part = blocks.block_forward(
                query[piece.rows],
                k[piece.keys],
                v[piece.keys],
                softmax_scale=softmax_scale,
                causal=piece.causal,
                band=piece.band,
            )
            merged.add(piece.rows, part, length, first=not covered[piece.rows.start])
            covered[piece.rows] = [True] * (piece.rows.stop - piece.rows.start)
        if pending is not None:
            _wait(pending[1])
            kv = pending[0]
    if sinks is not None:
        merged.add_sinks(sinks)
    out, row_max, row_sum = merged.stats
    return out[..., : sizes.value], row_max, row_sum


def _block_grads(
    piece: Piece, saved: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one piece (at the blocks' width)."""
    query, dout, out, row_max, row_sum = saved
    rows, keys = piece.rows, piece.keys
    return blocks.block_backward(
        query[rows],
        k[keys],
        v[keys],
        dout[rows],
        out[rows],
        row_max[:, :, rows],
        row_sum[:, :, rows],
        softmax_scale=softmax_scale,
        causal=piece.causal,
        band=piece.band,
    )


def sinks_grad(saved: tuple[torch.Tensor, ...], sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks[h]: the sink's probability p_sink (its logit over the whole row's statistics) takes
    d out / d sink = -p_sink * out, so the gradient is -sum over the head's rows of p_sink * (dout . out)."""
    _, dout, out, row_max, row_sum = saved
    wide = row_max.dtype  # the statistics' precision: fp32 for 16-bit inputs, as the kernels keep them
    p_sink = torch.exp(sinks.to(wide).view(1, -1, 1) - row_max[..., 0]) / row_sum[..., 0]  # [b, np, s]
    row_dot = (dout.to(wide) * out.to(wide)).sum(dim=-1).permute(1, 2, 0)  # [s, b, np] -> [b, np, s]
    return -(p_sink * row_dot).sum(dim=(0, 2)).to(sinks.dtype)


def ring_backward(
    saved: tuple[torch.Tensor, ...],
    key: torch.Tensor,
    value: torch.Tensor,
    ring: Ring,
    softmax_scale: float,
    window: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this rank's query, key and value (the statistics hold the sinks' term, whose key has
    value 0: the blocks' backward is the same with them)."""
    sizes = HeadSizes(key, value)
    query, dout, out, row_max, row_sum = saved
    # the blocks' width: out and dout's zero channels leave the row sums of dout * out as they are
    saved = (sizes.widen(query), sizes.widen(dout), sizes.widen(out), row_max, row_sum)
    length = query.shape[0]
    dq = torch.zeros(saved[0].shape, dtype=torch.float32, device=query.device)
    kv = sizes.pack(key, value)
    dkv_pending = None
    for step in range(ring.size):
        kv_pending = ring.shift(kv) if step + 1 < ring.size else None
        if dkv_pending is None:
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        else:
            _wait(dkv_pending[1])
            dkv = dkv_pending[0]
        k, v = sizes.block(kv)
        for piece in step_pieces(ring.rank, ring.size, step, length, window):
            dq_part, dk, dv = _block_grads(piece, saved, k, v, softmax_scale)
            dq[piece.rows] += dq_part.float()
            dkv[piece.keys, ..., : sizes.key] += dk[..., : sizes.key].float()
            dkv[piece.keys, ..., sizes.key :] += dv[..., : sizes.value].float()
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
    """Causal (or sliding-window) attention of the load-balanced local sequence over the whole ring, with
    optional sinks (one logit per query head), and its backward."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sinks: torch.Tensor | None,
        ring: Ring,
        softmax_scale: float,
        window: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        out, row_max, row_sum = ring_forward(query, key, value, ring, softmax_scale, window, sinks)
        ctx.ring, ctx.softmax_scale, ctx.window, ctx.has_sinks = ring, softmax_scale, window, sinks is not None
        ctx.save_for_backward(query, key, value, out, row_max, row_sum, sinks)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> Any:
        query, key, value, out, row_max, row_sum, sinks = ctx.saved_tensors
        saved = (query, dout.contiguous(), out, row_max, row_sum)
        dq, dk, dv = ring_backward(saved, key, value, ctx.ring, ctx.softmax_scale, ctx.window)
        d_sinks = sinks_grad(saved, sinks) if ctx.has_sinks and ctx.needs_input_grad[3] else None
        return dq, dk, dv, d_sinks, None, None, None
