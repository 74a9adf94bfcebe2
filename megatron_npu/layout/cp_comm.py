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
For the planner: ``cp_traffic(...)`` per layer and ``placement_note(...)`` for the layout.
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


def cp_traffic(
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
) -> CpTraffic:
    """The bytes one rank sends for one layer's core attention, forward and backward."""
    if cp == 1:
        return CpTraffic()
    a2a, ring = split_sizes(comm_type, cp, hierarchical_sizes)
    tokens = seq_length // cp * micro_batch_size  # this rank's share before any all-to-all
    heads, groups = num_attention_heads // tp, max(num_query_groups // tp, 1)
    q_elements, kv_elements = tokens * heads * head_dim, tokens * groups * head_dim
    # after the all-to-all a rank holds A x the tokens and 1/A of the heads: the same element count
    block = 2 * kv_elements
    ring_forward = (ring - 1) * block * dtype_bytes
    ring_backward = ring_forward + ring * block * ACCUMULATOR_BYTES if ring > 1 else 0
    moved = (a2a - 1) / a2a
    a2a_once = round((2 * q_elements + 2 * kv_elements) * moved) * dtype_bytes  # q, k, v out; attention back
    return CpTraffic(ring_forward, ring_backward, a2a_once, a2a_once)


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
