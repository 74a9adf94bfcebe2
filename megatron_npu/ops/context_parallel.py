"""Core attention with context parallelism, without Transformer Engine.

megatron-core 0.16's local ``DotProductAttention`` refuses ``context_parallel_size > 1`` (only
``TEDotProductAttention`` has CP). ``ContextParallelAttention`` takes its place in the layer spec
(ops/spec_provider.py) and leaves megatron-core's own CP plumbing as it is: the batch split into
``2 x CP`` chunks in ``get_batch_on_this_cp_rank``'s load-balanced order, RoPE sliced the same
way, the CP groups of ``parallel_state`` and the gradient reduction over DP x CP.

``--cp-comm-type`` (one for all layers or one per layer), as Megatron-LM defines them:

- ``p2p``: ring attention over the CP group (ops/cp_ring.py);
- ``a2a``: Ulysses: an all-to-all turns the sequence split into a head split, every rank attends
  over the whole sequence for ``heads / CP`` heads, and a second all-to-all turns it back;
- ``a2a+p2p`` with ``--hierarchical-context-parallel-sizes A P``: all-to-all inside groups of
  ``A`` consecutive CP ranks, ring over the ``P`` groups.

One path covers all three: the all-to-all (over ``A`` ranks, 1 for p2p) gathers the ``2A`` chunks
of its group in the order that makes them the two load-balanced chunks of a ring of ``P`` ranks
(``A`` chunks each: CP rank ``pA + j`` holds chunks ``pA + j`` and ``2CP - 1 - pA - j``), and the
ring (``P`` ranks, 1 for a2a: plain causal attention) runs on them.

gpt-oss's attention runs on the same path (megatron-core 0.16.1 has it under CP with Transformer Engine only): a
layer's sliding window (``--window-size``, ``--window-attn-skip-freq``) masks each ring block from the global token
positions (ops/cp_ring.py), and the sinks of ``--softmax-type off-by-one / learnable`` (megatron-core's
``softmax_offset``, same parameter and checkpoint key) join each row's softmax once, in the ring's last merge; after
the all-to-all each rank holds the sinks of its heads.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_npu.compat.core import layer_window, softmax_type
from megatron_npu.ops.cp_ring import Ring, RingAttention

COMM_TYPES = ("p2p", "a2a", "a2a+p2p")


def _all_to_all(parts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """parts[j] goes to rank j; the result's [j] came from rank j."""
    parts = parts.contiguous()
    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts, group=group)
    return received


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[2c, b, h, d] (chunks r, 2CP-1-r) -> [2cA, b, h/A, d]: the group's first chunks in rank order,
    then its second chunks in reverse rank order (the two chunks of the group in sequence order)."""
    size = dist.get_world_size(group)
    s, b, h, d = x.shape
    parts = x.reshape(s, b, size, h // size, d).permute(2, 0, 1, 3, 4)
    gathered = _all_to_all(parts, group).view(size, 2, s // 2, b, h // size, d)
    firsts = gathered[:, 0].reshape(size * s // 2, b, h // size, d)
    seconds = gathered[:, 1].flip(0).reshape(size * s // 2, b, h // size, d)
    return torch.cat((firsts, seconds))


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of sequence_to_heads: [2cA, b, h/A, d] -> [2c, b, h, d]."""
    size = dist.get_world_size(group)
    s, b, h, d = x.shape
    halves = x.view(2, size, s // (2 * size), b, h, d)
    parts = torch.stack((halves[0], halves[1].flip(0)), dim=1).reshape(size, s // size, b, h, d)
    return _all_to_all(parts, group).permute(1, 2, 0, 3, 4).reshape(s // size, b, size * h, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # an all-to-all is a permutation: its gradient is the inverse permutation
        return heads_to_sequence(grad.contiguous(), ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return sequence_to_heads(grad.contiguous(), ctx.group), None


def layer_comm_type(config: TransformerConfig, layer_number: int, given: str | None) -> str:
    """This layer's --cp-comm-type: the one megatron-core passes, else the config's (a list holds
    one per layer, 1-based layer numbers), else Megatron-LM's default p2p."""
    chosen = given
    if chosen is None:
        configured = config.cp_comm_type
        chosen = configured[layer_number - 1] if isinstance(configured, list) else configured
    chosen = chosen or "p2p"
    if chosen not in COMM_TYPES:
        raise ValueError(
            f"--cp-comm-type {chosen} is not available without Transformer Engine; use one of {', '.join(COMM_TYPES)}"
        )
    return chosen


def _hierarchical_groups(config: TransformerConfig, pg_collection: Any) -> list:
    """[a2a group, ring group] of --hierarchical-context-parallel-sizes A P (parallel_state's groups)."""
    sizes = config.hierarchical_context_parallel_sizes
    if not sizes or len(sizes) != 2:
        raise ValueError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes with two sizes (a2a p2p)")
    groups = getattr(pg_collection, "hcp", None) or parallel_state.get_hierarchical_context_parallel_groups()
    return list(groups)


class ContextParallelAttention(MegatronModule):
    """Causal core attention over a sequence split across the CP group (same constructor and
    forward as megatron-core's DotProductAttention)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        # k_channels / v_channels: multi-latent attention's q/k and v head sizes (MLASelfAttention passes them, as
        # to Transformer Engine's attention); the ring reads both from the tensors, only the default scale needs one
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        _check_supported(config, attn_mask_type, attention_dropout)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp_size = pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp_size
        self.groups = config.num_query_groups // tp_size
        head_size = k_channels if k_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_size)
        self.comm_type = layer_comm_type(config, layer_number, cp_comm_type)
        self.inner, ring_group = self._groups(pg_collection)
        self.ring = Ring(ring_group)
        self._check_heads()
        self.tp_group = pg_collection.tp
        window = layer_window(config, self.layer_number)
        self.window = None if window is None else (int(window[0]), int(window[1]))
        self._softmax_offset()

    def _softmax_offset(self) -> None:
        """megatron-core's DotProductAttention.softmax_offset: the sinks' logits of this TP rank's heads, zeros for
        off-by-one, a parameter for learnable (same name, shape, initialization and checkpoint key)."""
        kind = softmax_type(self.config)
        if kind == "vanilla":
            self.softmax_offset = None
        elif kind == "off-by-one":
            self.softmax_offset = torch.zeros(
                self.heads, device=torch.cuda.current_device(), dtype=self.config.params_dtype
            )
        elif kind == "learnable":
            offset = torch.empty(self.heads, device=torch.cuda.current_device(), dtype=self.config.params_dtype)
            self.register_parameter("softmax_offset", torch.nn.Parameter(offset))
            if self.config.perform_initialization:
                self.softmax_offset = self.config.init_method(self.softmax_offset)
        else:
            raise ValueError(f"--softmax-type {kind} is not supported")

    def _local_sinks(self) -> torch.Tensor | None:
        """The sinks of the heads this rank attends for: all of them on the ring, its head share after the
        all-to-all (slicing scatters the gradient back, zero elsewhere; the DP x CP reduction sums the shares)."""
        if self.softmax_offset is None or self.inner is None:
            return self.softmax_offset
        return self.softmax_offset.chunk(self.inner.size())[self.inner.rank()]

    def _groups(self, pg_collection: Any) -> tuple[Any, Any]:
        """(all-to-all group or None, ring group or None) of this layer's comm type."""
        cp_group = pg_collection.cp
        if cp_group.size() == 1:
            return None, None
        if self.comm_type == "p2p":
            return None, cp_group
        if self.comm_type == "a2a":
            return cp_group, None
        inner, outer = _hierarchical_groups(self.config, pg_collection)
        return inner, outer

    def _check_heads(self) -> None:
        if self.inner is None:
            return
        size = self.inner.size()
        if self.heads % size or self.groups % size:
            raise ValueError(
                f"--cp-comm-type {self.comm_type}: the all-to-all over {size} ranks needs attention heads "
                f"({self.heads}) and query groups ({self.groups}) per tensor-parallel rank divisible by {size}; "
                "change --num-attention-heads / --num-query-groups or use --cp-comm-type p2p"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """query [s/CP, b, np, hk], key [s/CP, b, ng, hk], value [s/CP, b, ng, hv] -> [s/CP, b, np * hv] (the
        mask is the causal one this module computes itself)."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("context parallelism without Transformer Engine has no packed sequences or attention bias")
        if (attn_mask_type or self.attn_mask_type) != AttnMaskType.causal:
            raise ValueError("context parallelism without Transformer Engine needs causal attention")
        seq, batch = query.shape[:2]
        tensors = [t.contiguous() for t in (query, key, value)]
        if self.inner is not None:
            tensors = [_SequenceToHeads.apply(t, self.inner) for t in tensors]
        out = RingAttention.apply(*tensors, self._local_sinks(), self.ring, self.softmax_scale, self.window)
        if self.inner is not None:
            out = _HeadsToSequence.apply(out, self.inner)
        return out.reshape(seq, batch, -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """megatron-core's DotProductAttention's: the learnable sinks split over TP, nothing otherwise."""
        if softmax_type(self.config) != "learnable":
            return {}
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state_dict,
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


def _check_supported(config: TransformerConfig, attn_mask_type: AttnMaskType, dropout: float | None) -> None:
    dropout = config.attention_dropout if dropout is None else dropout
    if dropout:
        raise ValueError(
            "context parallelism without Transformer Engine has no attention dropout; set --attention-dropout 0"
        )
    if attn_mask_type != AttnMaskType.causal:
        raise ValueError(
            "context parallelism without Transformer Engine needs causal attention (--attention-mask-type)"
        )
