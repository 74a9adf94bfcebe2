"""What context parallelism moves per transformer layer, and where its groups sit (no torch).

The traffic of megatron_npu/ops/context_parallel.py for one layer and one micro-batch, per rank
(bytes a rank sends; it receives as much):

- ring (``p2p``, and the ring part of ``a2a+p2p`` over P ranks): the forward passes the
  key/value block on P - 1 times; the backward passes it on P - 1 times again and the dK/dV
  accumulator (fp32) P times, back to the block's owner;
- all-to-all (``a2a``, and the a2a part of ``a2a+p2p`` over A ranks): q, k, v to the head split
  and the output back in the forward, their gradients the other way in the backward; a rank keeps
  1/A of each tensor and sends the rest.

megatron-core orders ranks tp-cp-ep-dp-pp: a CP group is CP ranks TP apart, so TP x CP contiguous
ranks hold one TP x CP block. It stays on one node's links when TP x CP divides the ranks per node.
For the planner: ``cp_calls(...)`` (each torch.distributed call of one layer: the payload
megatron_npu/perf/comm.py counts, sends and receives alike), ``cp_traffic(...)`` (what a rank sends,
summed from the same calls) and ``placement_note(...)`` for the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the dK/dV accumulator travels in fp32 whatever the activations' dtype
ACCUMULATOR_BYTES = 4


@dataclass(frozen=True)
class CpTraffic:
    """Bytes one rank sends for one layer and one micro-batch."""

    ring_forward: int = 0
    ring_backward: int = 0
    a2a_forward: int = 0
    a2a_backward: int = 0

    @property
    def forward(self) -> int:
        return self.ring_forward + self.a2a_forward

    @property
    def backward(self) -> int:
        return self.ring_backward + self.a2a_backward


def split_sizes(comm_type: str, cp: int, hierarchical_sizes: list[int] | None = None) -> tuple[int, int]:
    """(all-to-all ranks A, ring ranks P) of one comm type; A x P = CP."""
    if comm_type == "p2p":
        return 1, cp
    if comm_type == "a2a":
        return cp, 1
    if comm_type == "a2a+p2p":
        if (
            not hierarchical_sizes
            or len(hierarchical_sizes) != 2
            or hierarchical_sizes[0] * hierarchical_sizes[1] != cp
        ):
            raise ValueError("a2a+p2p needs two hierarchical sizes (a2a, p2p) whose product is CP")
        return hierarchical_sizes[0], hierarchical_sizes[1]
    raise ValueError(f"unknown CP comm type {comm_type!r}")


@dataclass(frozen=True)
class CpCall:
    """``calls`` torch.distributed calls of ``payload`` bytes each, for one layer and one micro-batch.
    ``kind``: ``ring`` (the ring group: the CP group, or the ring level of a2a+p2p) or ``a2a``
    (the CP group, or the a2a level); ``group_size``: that group's ranks."""

    kind: str
    op: str  # send | recv | all_to_all
    phase: str  # forward | backward
    what: str
    calls: int
    payload: int
    group_size: int

    @property
    def sent(self) -> int:
        """Bytes this rank sends: a send's tensor, the (A - 1) / A of an all-to-all's input that leaves."""
        if self.op == "send":
            return self.calls * self.payload
        if self.op == "all_to_all":
            return self.calls * (self.payload * (self.group_size - 1) // self.group_size)
        return 0


def _pair(a: tuple[str, int], b: tuple[str, int]) -> list[tuple[str, int, int]]:
    """(what, calls, payload) of two all-to-alls: one row when their payloads are equal."""
    if a[1] == b[1]:
        return [(f"{a[0]} and {b[0]}", 2, a[1])]
    return [(a[0], 1, a[1]), (b[0], 1, b[1])]


def cp_calls(
    *,
    seq_length: int,
    micro_batch_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    head_dim: int,
    tp: int,
    cp: int,
    comm_type: str = "p2p",
    hierarchical_sizes: list[int] | None = None,
    dtype_bytes: int = 2,
    v_head_dim: int | None = None,
) -> list[CpCall]:
    """The calls one rank makes for one layer's core attention (ops/context_parallel.py, ops/cp_ring.py).
    ``head_dim``: the query / key head size; ``v_head_dim``: the value's (and the output's), None: the same
    (multi-latent attention: ``qk_head_dim + qk_pos_emb_head_dim`` and ``v_head_dim``)."""
    if cp == 1:
        return []
    a2a, ring = split_sizes(comm_type, cp, hierarchical_sizes)
    tokens = seq_length // cp * micro_batch_size  # this rank's share before any all-to-all
    heads, groups = num_attention_heads // tp, max(num_query_groups // tp, 1)
    qk_elements, v_elements = tokens * head_dim, tokens * (head_dim if v_head_dim is None else v_head_dim)
    q_bytes, out_bytes = heads * qk_elements * dtype_bytes, heads * v_elements * dtype_bytes
    k_bytes, v_bytes = groups * qk_elements * dtype_bytes, groups * v_elements * dtype_bytes
    # the ring's block is K and V side by side on the last dim; its accumulator the same elements in fp32
    block, accumulator = k_bytes + v_bytes, (k_bytes + v_bytes) // dtype_bytes * ACCUMULATOR_BYTES
    out: list[CpCall] = []
    if ring > 1:  # every shift is one send and one receive of the same tensor
        for op in ("send", "recv"):
            out.append(CpCall("ring", op, "forward", "K/V block", ring - 1, block, ring))
            out.append(CpCall("ring", op, "backward", "K/V block", ring - 1, block, ring))
            out.append(CpCall("ring", op, "backward", "dK/dV accumulator (fp32)", ring, accumulator, ring))
    if a2a > 1:  # q, k, v to the head split and the output back; their gradients the other way
        # after the all-to-all a rank holds A x the tokens and 1/A of the heads: the same element count
        tensors = _pair(("q", q_bytes), ("the output", out_bytes)) + _pair(("k", k_bytes), ("v", v_bytes))
        for phase in ("forward", "backward"):
            out += [CpCall("a2a", "all_to_all", phase, what, calls, size, a2a) for what, calls, size in tensors]
    return out


def cp_traffic(**shape: object) -> CpTraffic:
    """The bytes one rank sends for one layer's core attention, forward and backward (``cp_calls``'s
    arguments)."""
    sent: dict[tuple[str, str], int] = {}
    for call in cp_calls(**shape):  # type: ignore[arg-type]
        sent[call.kind, call.phase] = sent.get((call.kind, call.phase), 0) + call.sent
    return CpTraffic(
        *(
            sent.get(key, 0)
            for key in [("ring", "forward"), ("ring", "backward"), ("a2a", "forward"), ("a2a", "backward")]
        )
    )


def placement_note(tp: int, cp: int, nproc_per_node: int | None) -> str | None:
    """None when each TP x CP block of ranks lies inside one node (or CP is 1); else one line
    saying which traffic crosses nodes and what would fit."""
    if cp == 1 or nproc_per_node is None:
        return None
    block = tp * cp
    if block <= nproc_per_node and nproc_per_node % block == 0:
        return None
    fits = [c for c in range(1, cp + 1) if cp % c == 0 and tp * c <= nproc_per_node and nproc_per_node % (tp * c) == 0]
    return (
        f"TP {tp} x CP {cp} = {block} ranks do not fit in a node of {nproc_per_node}: the CP ring / all-to-all "
        f"crosses nodes every layer; CP sizes that keep TP x CP inside a node: {', '.join(map(str, fits))} "
        "(or use a2a+p2p with the a2a part inside the node)"
    )
