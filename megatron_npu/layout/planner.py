"""Communication planner: what each rank passes to torch.distributed per training iteration.

The ``megatron-npu plan`` command is megatron_npu/layout/plan_cli.py (memory: memory.py; --search: search.py).

Definitions (shared with ``megatron_npu.perf.comm.CommCounter`` so a plan can be checked
against a measured run):

* **payload bytes**: ``numel * element_size`` of the tensor(s) a rank hands to a
  torch.distributed collective or p2p call: the input of all_reduce / broadcast, the
  *input shard* of all_gather(_into_tensor), the *full input* of reduce_scatter(_tensor),
  the tensor of send/isend and of recv/irecv (receives count too).
* **wire bytes** (separate column): what a ring algorithm makes this rank send:
  all-reduce 2(g-1)/g*N, all-gather (g-1)*shard, reduce-scatter (g-1)/g*N, send N, recv 0.
  A collective whose group spans nodes is counted as inter-node traffic (a ring runs at
  the pace of its slowest link); p2p goes by the peer's node.

Process-group labels are the ones the trainer hands to ``CommCounter.label_groups``:
tp, pp, dp_cp (DDP reduces gradients over data-parallel *with* context-parallel), dp (the
trainer's loss report), embd, mp (tensor x pipeline, grad-norm all-reduce without the distributed optimizer) and dist_opt
(``parallel_state.get_intra_distributed_optimizer_instance_group()``, grad norm with it).

What is modelled, from megatron-core 0.16 (local spec, GPT): per layer 2 row-parallel
all-reduces forward and 2 column-parallel dgrad all-reduces backward; with sequence
parallelism 2 all-gathers + 2 reduce-scatters forward, and backward 2 recomputed
all-gathers + 2 reduce-scatters (column) + 2 all-gathers (row); the vocab-parallel
embedding's forward reduction; the output layer's column-parallel communication; the
vocab-parallel cross-entropy's 3 fp32 all-reduces of [s, b] (called even when TP=1); the
SP norm/bias gradient all-reduce; 1F1B p2p (one activation and one gradient per microbatch
per boundary); DDP's per-bucket all-reduce or reduce-scatter of the grad buffer (padded as
the distributed optimizer pads it) and its param all-gather; the tied-embedding gradient
all-reduce; the 1-float grad-norm all-reduce; the trainer's loss all-reduce over dp x cp on the
last stage (pretrain_gpt.py's 'lm loss' report, [sum, count]: 2 floats); with per-token loss,
the token count's broadcast over pp and all-reduce over dp (1 int32 each). Full recomputation of
every layer is an option (unverified). Not modelled: partial recomputation, cross-entropy
loss fusion, logging/eval/checkpoint collectives, one-time set-up collectives. CP attention (ring K/V
per layer forward and backward, all-to-alls, both levels of a2a+p2p) and FSDP's per-unit collectives
instead of DDP's buckets: plan_cp_fsdp.py.

MoE (``--num-experts``; megatron-core 0.16.1's SequentialMLP experts): an MoE layer's router and
shared experts in the dense buffer (dp_cp); under EP > 1 the experts in a DDP buffer of their own,
reduced over expert data parallel (edp; under FSDP their units, sharded over it), with the expert
optimizer's grad norm on expert TP x EP x PP (expert_mp, without the distributed optimizer); with the
alltoall dispatcher the expert all-to-all on ep (``expert_all_to_all_bytes``) and each micro-batch's
token counts per expert gathered over expert TP x EP (tp_ep, int64); the trainer's MoE loss report
reduces megatron-core's [num_layers] tracker per loss over pp, then tp_cp and dp for the balancing
losses of a stage with MoE layers. All checked byte for byte per group against a dropless top-2 EP2 x DP2 run
(tests/training/test_moe.py). Modelled but unchecked: the aux loss's token-count all-reduce over TP x CP > 1.
Not modelled: the expert-TP gathers of the dispatcher (expert TP > 1), the MoE layers' TP traffic
(counted as a dense MLP's), global_aux_loss, the allgather dispatcher.

Checked call for call against CommCounter on real megatron-core steps (gloo, cpu): world 1
with and without the distributed optimizer, TP2, TP2 + SP + distributed optimizer, PP2
(tied), PP2 untied + distributed optimizer, DP2 + distributed optimizer
(tests/fixtures/layout/comm_check_worker.py). VPP figures are unchecked; the CP
ring's rows equal the counted bytes of a TP2 x CP2 run (tests/perf/test_perf_report.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from megatron_npu.accelerator.facts import PLANNING_FACTS
from megatron_npu.layout.buckets import bucket_layout
from megatron_npu.layout.model_shape import ModelShape, pad_vocab_size
from megatron_npu.layout.moe import moe_layer_pattern
from megatron_npu.layout.parallel_dims import ParallelDims
from megatron_npu.layout.plan_cp_fsdp import plan_cp, plan_fsdp
from megatron_npu.layout.rankmap import RankMap, cp_placement

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Assumed link bandwidths: facts of the target (megatron_npu/accelerator/facts.py); measure
# and override with --intra-gbps / --inter-gbps.
HCCS_GBPS = PLANNING_FACTS.intra_node_gbps  # GB/s per device inside a node
ROCE_GBPS = PLANNING_FACTS.inter_node_gbps  # GB/s per device between nodes
LABELS = ("tp", "cp", "cp_a2a", "cp_ring", "pp", "dp_cp", "dp", "embd", "mp", "dist_opt", "ep", "edp", "tp_ep")
LABELS += ("expert_mp", "tp_cp")


def expert_all_to_all_bytes(
    *,
    micro_batch_size: int,
    seq_length: int,
    hidden_size: int,
    topk: int,
    moe_layers: int,
    microbatches: int,
    dtype_bytes: int,
    probs_bytes: int | None = None,
    tokens_split: int = 1,
) -> int:
    """Payload bytes an EP rank hands to all_to_all_single per step (alltoall dispatcher, dropless),
    as the mean over its EP group: per MoE layer and micro-batch megatron-core sends the tokens and
    their routing probabilities to the experts and the expert outputs back, and the gradients of
    all three in backward; each moves every local token-expert pair ([tokens x topk, hidden], and
    [tokens x topk] probabilities) once. A rank's own figure is its sends (forward dispatch,
    backward of the combine) plus what routing sends it, so it varies with the routing while the
    group's sum does not. ``tokens_split``: what divides the router's tokens (TP with sequence
    parallelism, x CP). ``probs_bytes``: the routing probabilities' dtype (default the params')."""
    pairs = micro_batch_size * seq_length // tokens_split * topk
    per_layer = 4 * pairs * hidden_size * dtype_bytes + 2 * pairs * (probs_bytes or dtype_bytes)
    return per_layer * moe_layers * microbatches


@dataclass
class ModelSpec:
    """GPT shape, named as Megatron-LM's flags."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    vocab_size: int
    ffn_hidden_size: int | None = None  # None: Megatron-LM's default (4h; SwiGLU: 8h/3 rounded to 64)
    num_query_groups: int | None = None  # None: no GQA
    kv_channels: int | None = None  # None: hidden / heads
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    normalization: str = "LayerNorm"  # or RMSNorm (no bias)
    position_embedding_type: str = "learned_absolute"  # or rope
    max_position_embeddings: int | None = None  # None: seq_length
    make_vocab_size_divisible_by: int = 128
    params_dtype: str = "bf16"
    grad_reduce_in_fp32: bool | None = None  # None: Megatron-LM's rule, True for bf16
    num_experts: int | None = None  # MoE: experts per MoE layer
    moe_router_topk: int = 2
    moe_layer_freq: int | list[int] = 1
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_token_dispatcher_type: str = "alltoall"  # the EP all-to-all is modelled for alltoall
    moe_pad_expert_input_to_capacity: bool = False
    moe_router_load_balancing_type: str | list[str] = "aux_loss"
    moe_aux_loss_coeff: float | list[float] = 0.0
    moe_z_loss_coeff: float | None = None

    @classmethod
    def from_shape(cls, shape: ModelShape, **training: object) -> ModelSpec:
        """The shape's resolved sizes plus the batch, dtype and architecture fields."""
        return cls(
            num_layers=shape.num_layers,
            hidden_size=shape.hidden_size,
            num_attention_heads=shape.num_attention_heads,
            vocab_size=shape.vocab_size,
            ffn_hidden_size=shape.ffn_hidden_size,
            num_query_groups=shape.num_query_groups,
            kv_channels=shape.kv_channels,
            swiglu=shape.swiglu,
            make_vocab_size_divisible_by=shape.make_vocab_size_divisible_by,
            **training,
        )  # type: ignore[arg-type]

    @property
    def shape(self) -> ModelShape:
        """Megatron-LM's defaults applied: the same object the trainer's validation uses."""
        return ModelShape.build(
            self.num_layers,
            self.hidden_size,
            self.num_attention_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            kv_channels=self.kv_channels,
            num_query_groups=self.num_query_groups,
            swiglu=self.swiglu,
            vocab_size=self.vocab_size,
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
        )

    @property
    def ffn(self) -> int:
        return self.shape.ffn_hidden_size

    @property
    def tied(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def moe_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn

    def moe_layers(self, start: int, count: int) -> list[bool]:
        """Which of layers ``start`` .. ``start + count - 1`` are MoE layers (none without experts)."""
        if not self.num_experts:
            return [False] * count
        return moe_layer_pattern(self.moe_layer_freq, self.num_layers)[start : start + count]

    def tracked_moe_losses(self) -> list[tuple[str, bool]]:
        """The MoE losses the trainer logs (training/reporting.py's moe_track_names), each with whether
        megatron-core's router registers a reduce group for it (the balancing losses with a coefficient:
        TP x CP, then DP) or only the pipeline reduce runs (z-loss; a zero coefficient)."""
        types = self.moe_router_load_balancing_type
        types = [types] if isinstance(types, str) else list(types)
        coeffs = self.moe_aux_loss_coeff if isinstance(self.moe_aux_loss_coeff, list) else [self.moe_aux_loss_coeff]
        coeff = dict(zip(types, coeffs * len(types) if len(coeffs) == 1 else coeffs, strict=True))
        names = [
            (name, coeff[kind] > 0)
            for kind, name in (("aux_loss", "load_balancing_loss"), ("seq_aux_loss", "seq_load_balancing_loss"))
            if kind in types
        ]
        return names + ([("z_loss", False)] if self.moe_z_loss_coeff is not None else [])

    def padded_vocab(self, tp: int) -> int:
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    def grad_bytes(self) -> int:
        fp32 = self.grad_reduce_in_fp32 if self.grad_reduce_in_fp32 is not None else self.params_dtype == "bf16"
        return 4 if fp32 else DTYPE_BYTES[self.params_dtype]


@dataclass
class ParallelSpec:
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False  # buckets of max(40M, 1M*dp) elements on pp rank 0
    bucket_size: int | None = None
    clip_grad: float = 1.0
    recompute_full: bool = False  # --recompute-granularity full: each layer's forward runs again in backward
    loss_allreduce: bool = True  # megatron_npu.training: 'lm loss' [sum, count] (2 fp32) over dp x cp, last stage
    per_token_loss: bool = False  # --calculate-per-token-loss: finalize_model_grads shares the token count
    cp_comm_type: str | list[str] = "p2p"  # --cp-comm-type: one, or one per layer (plan_cp_fsdp.py)
    hierarchical_cp_sizes: list[int] | None = None  # --hierarchical-context-parallel-sizes A P (a2a+p2p)
    fsdp: str | None = None  # a Megatron-FSDP sharding strategy or torch_fsdp2: FSDP's collectives, not DDP's


@dataclass
class Item:
    """One kind of call on one rank: ``calls`` calls of ``payload`` bytes each."""

    label: str
    op: str
    what: str
    calls: int
    payload: int
    group_size: int
    inter: bool

    @property
    def bytes(self) -> int:
        return self.calls * self.payload

    @property
    def wire(self) -> float:
        g, n = self.group_size, self.bytes
        if self.op == "send":
            return float(n)
        if self.op == "recv" or g == 1:
            return 0.0
        if self.op == "all_reduce":
            return 2 * (g - 1) / g * n
        if self.op == "all_gather":
            return float((g - 1) * n)
        if self.op == "all_to_all":  # evenly routed tokens: all but this rank's own share leave it
            return (g - 1) / g * n
        return (g - 1) / g * n  # reduce_scatter


@dataclass
class RankPlan:
    rank: int
    node: int
    pp_rank: int
    items: list[Item] = field(default_factory=list)

    def by_label(self) -> dict[str, dict[str, float]]:
        """{label: {"calls", "bytes", "wire_intra", "wire_inter"}}, comparable to CommCounter.snapshot()."""
        out: dict[str, dict[str, float]] = {}
        for it in self.items:
            d = out.setdefault(it.label, {"calls": 0, "bytes": 0, "wire_intra": 0.0, "wire_inter": 0.0})
            d["calls"] += it.calls
            d["bytes"] += it.bytes
            d["wire_inter" if it.inter else "wire_intra"] += it.wire
        return out


@dataclass
class CommPlan:
    layout: RankMap
    model: ModelSpec
    parallel: ParallelSpec
    ranks: list[RankPlan]
    intra_gbps: float
    inter_gbps: float

    def time_s(self, rank: int) -> float:
        """Communication seconds per iteration with no overlap, at the assumed bandwidths."""
        d = self.ranks[rank].by_label().values()
        return sum(v["wire_intra"] for v in d) / (self.intra_gbps * 1e9) + sum(v["wire_inter"] for v in d) / (
            self.inter_gbps * 1e9
        )

    def distinct(self) -> list[RankPlan]:
        """One rank per distinct traffic pattern (ranks of a TP group match, and so on)."""
        seen: dict[str, RankPlan] = {}
        for rp in self.ranks:
            key = json.dumps(
                {k: [v["calls"], v["bytes"], v["wire_inter"] > 0] for k, v in sorted(rp.by_label().items())}
            )
            seen.setdefault(key, rp)
        return list(seen.values())

    def table(self) -> str:
        lay = self.layout
        mb = self.model.global_batch_size // (self.model.micro_batch_size * lay.dp)
        out = [
            f"TP={lay.tp} PP={lay.pp} CP={lay.cp} DP={lay.dp}"
            + (f" VPP={lay.vpp}" if lay.vpp else "")
            + f" on {lay.nnodes}x{lay.nproc_per_node}; {mb} microbatches/iteration; "
            f"SP={'on' if self.parallel.sequence_parallel else 'off'}, "
            f"distributed optimizer={'on' if self.parallel.use_distributed_optimizer else 'off'}; "
            f"grad reduce {self.model.grad_bytes() * 8}-bit",
            "payload = bytes handed to torch.distributed on the rank (receives included); "
            "wire = ring-algorithm bytes sent (MB = 1e6 bytes)",
        ]
        out += [cp_placement(lay)] if lay.cp > 1 else []
        for rp in self.distinct():
            same = [r.rank for r in self.ranks if r.by_label() == rp.by_label()]
            out.append(f"rank {rp.rank} (node {rp.node}, pp stage {rp.pp_rank}; same traffic: {len(same)} ranks)")
            out.append(f"  {'group':8} {'calls':>7} {'payload MB':>12} {'wire intra MB':>14} {'wire inter MB':>14}")
            for label, v in sorted(rp.by_label().items(), key=lambda kv: LABELS.index(kv[0])):
                out.append(
                    # 3 decimals: a scaled-down test model's traffic is well under 0.1 MB
                    f"  {label:8} {v['calls']:7d} {v['bytes'] / 1e6:12.3f} {v['wire_intra'] / 1e6:14.3f} {v['wire_inter'] / 1e6:14.3f}"
                )
            out.append(f"  est. communication time per iteration: {self.time_s(rp.rank) * 1e3:.3f} ms (no overlap)")
        out.append(
            f"ASSUMED bandwidths: intra-node {self.intra_gbps} GB/s ({PLANNING_FACTS.intra_node_link}), "
            f"inter-node {self.inter_gbps} GB/s ({PLANNING_FACTS.inter_node_link}); "
            "override with --intra-gbps/--inter-gbps"
        )
        return "\n".join(out)

    def to_json(self) -> dict:
        return {
            "definitions": {
                "bytes": "payload bytes of the tensors passed to torch.distributed collective/p2p calls on this rank",
                "wire": "ring-algorithm bytes sent by this rank",
            },
            "layout": {
                k: getattr(self.layout, k)
                for k in ("world_size", "nnodes", "nproc_per_node", "tp", "pp", "cp", "dp", "vpp")
            },
            "model": asdict(self.model),
            "parallel": asdict(self.parallel),
            "assumed_gbps": {"intra": self.intra_gbps, "inter": self.inter_gbps},
            "ranks": [
                {
                    "rank": rp.rank,
                    "node": rp.node,
                    "pp_rank": rp.pp_rank,
                    "groups": rp.by_label(),
                    "items": [asdict(it) | {"bytes": it.bytes, "wire": it.wire} for it in rp.items],
                    "est_seconds": self.time_s(rp.rank),
                }
                for rp in self.ranks
            ],
        }


def _stage_params(
    m: ModelSpec,
    tp: int,
    layers: int,
    first: bool,
    last: bool,
    pp: int,
    moe: list[bool] | None = None,
    experts: tuple[int, int] = (0, 1),
) -> list[tuple[str, int]]:
    """(name, numel) of one model chunk's parameters in named_parameters() order (local spec). An MoE
    layer (``moe``, per layer) has a router, ``experts`` = (local experts, expert TP) and the shared
    experts; under EP > 1 DDP reduces the experts (``_is_expert``) over expert data parallel."""
    shape = m.shape
    h, kv, groups = shape.hidden_size, shape.kv_channels, shape.num_query_groups
    norm = ["weight"] if m.normalization == "RMSNorm" else ["weight", "bias"]
    bias = m.add_bias_linear
    qkv_out = (m.num_attention_heads + 2 * groups) * kv // tp
    fc1_out = shape.fc1_out // tp
    vocab = m.padded_vocab(tp) // tp  # vocab-parallel rows on this rank
    out: list[tuple[str, int]] = []
    if first:
        out.append(("embedding.word_embeddings.weight", vocab * h))
        if m.position_embedding_type == "learned_absolute":
            out.append(("embedding.position_embeddings.weight", (m.max_position_embeddings or m.seq_length) * h))
    for i in range(layers):
        p = f"decoder.layers.{i}."
        out += [(p + "input_layernorm." + n, h) for n in norm]
        out.append((p + "self_attention.linear_proj.weight", h * m.num_attention_heads * kv // tp))
        out += [(p + "self_attention.linear_proj.bias", h)] if bias else []
        out.append((p + "self_attention.linear_qkv.weight", qkv_out * h))
        out += [(p + "self_attention.linear_qkv.bias", qkv_out)] if bias else []
        out += [(p + "pre_mlp_layernorm." + n, h) for n in norm]
        if moe and moe[i]:
            out += _moe_params(m, tp, p + "mlp.", *experts)
            continue
        out.append((p + "mlp.linear_fc1.weight", fc1_out * h))
        out += [(p + "mlp.linear_fc1.bias", fc1_out)] if bias else []
        out.append((p + "mlp.linear_fc2.weight", h * shape.ffn_hidden_size // tp))
        out += [(p + "mlp.linear_fc2.bias", h)] if bias else []
    if last:
        out += [("decoder.final_layernorm." + n, h) for n in norm]
        if not m.tied or not first:  # tied on one stage: the output layer reuses the embedding
            out.append(("output_layer.weight", vocab * h))
    return out


def _moe_params(m: ModelSpec, tp: int, prefix: str, local_experts: int, etp: int) -> list[tuple[str, int]]:
    """An MoE layer's parameters: the router (replicated), the local experts (SequentialMLP, no bias)
    and the shared experts."""
    h, ffn = m.hidden_size, m.moe_ffn
    out = [(prefix + "router.weight", (m.num_experts or 0) * h)]
    for e in range(local_experts):
        p = f"{prefix}experts.local_experts.{e}."
        out.append((p + "linear_fc1.weight", ffn * (2 if m.swiglu else 1) // etp * h))
        out.append((p + "linear_fc2.weight", h * ffn // etp))
    shared = m.moe_shared_expert_intermediate_size
    if shared:
        out.append((prefix + "shared_experts.linear_fc1.weight", shared * (2 if m.swiglu else 1) // tp * h))
        out.append((prefix + "shared_experts.linear_fc2.weight", h * shared // tp))
        out += [(prefix + "shared_experts.gate_weight", h)] if m.moe_shared_expert_gate else []
    return out


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _sp_marked(name: str) -> bool:
    """Params megatron marks ``sequence_parallel``: norms, row-parallel biases and the MoE router."""
    return "layernorm" in name or name.endswith(("linear_proj.bias", "linear_fc2.bias", "router.weight"))


def _buckets(
    params: list[tuple[str, int]], dp: int, dist_opt: bool, bucket_size: int | None, shared: set[str]
) -> list[int]:
    """Padded bucket sizes (elements): megatron-core _ParamAndGradBuffer's rules."""
    return [b.end - b.start for b in bucket_layout(params, dp, dist_opt, bucket_size, shared)]


def plan(
    model: ModelSpec,
    layout: RankMap,
    parallel: ParallelSpec | None = None,
    intra_gbps: float = HCCS_GBPS,
    inter_gbps: float = ROCE_GBPS,
) -> CommPlan:
    par = parallel or ParallelSpec()
    dims = layout.dims
    tp, pp, cp, dp = dims.tp, dims.pp, dims.cp, dims.dp
    vpp = dims.virtual_stages
    dims.check_num_layers(model.num_layers)
    dims.check_seq_length(model.seq_length, par.sequence_parallel)
    mbs = dims.microbatches(model.global_batch_size, model.micro_batch_size)
    if par.sequence_parallel and tp == 1:
        par = ParallelSpec(**(asdict(par) | {"sequence_parallel": False}))  # megatron turns SP off at TP=1
    pb, gb = DTYPE_BYTES[model.params_dtype], model.grad_bytes()
    s_local = model.seq_length // cp
    act = s_local * model.micro_batch_size * model.hidden_size * pb  # one [s, b, h] activation
    act_sp = act // tp
    scalar = s_local * model.micro_batch_size * 4  # one fp32 [s, b]
    chunk_layers = dims.layers_per_chunk(model.num_layers)
    sp = par.sequence_parallel
    bucket_size = par.bucket_size or max(40_000_000, 1_000_000 * dp * cp)

    moe = bool(model.num_experts)
    local_experts = model.num_experts // dims.ep if moe else 0  # type: ignore[operator]

    def group(name: str, rank: int) -> list[int]:
        return next(g for g in layout.groups[name] if rank in g)

    out = []
    for e in layout.ranks:
        rp = RankPlan(e.rank, e.node, e.pp_rank)
        tpg, ppg, dpg = group("tp", e.rank), group("pp", e.rank), group("dp_cp", e.rank)
        tp_inter, dp_inter = layout.spans_nodes(tpg), layout.spans_nodes(dpg)

        def add(label: str, op: str, what: str, calls: int, payload: int, g: list[int], inter: bool) -> None:
            if calls:
                rp.items.append(Item(label, op, what, calls, payload, len(g), inter))  # noqa: B023

        first, last = e.pp_rank == 0, e.pp_rank == pp - 1
        layers_here = chunk_layers * vpp
        # tensor parallel, per microbatch
        if tp > 1:
            if sp:
                add(
                    "tp",
                    "all_gather",
                    "layers: qkv/fc1 fwd + bwd recompute, proj/fc2 bwd",
                    6 * layers_here * mbs,
                    act_sp,
                    tpg,
                    tp_inter,
                )
                add(
                    "tp",
                    "reduce_scatter",
                    "layers: proj/fc2 fwd, qkv/fc1 dgrad",
                    4 * layers_here * mbs,
                    act,
                    tpg,
                    tp_inter,
                )
            else:
                add(
                    "tp", "all_reduce", "layers: proj/fc2 fwd, qkv/fc1 dgrad", 4 * layers_here * mbs, act, tpg, tp_inter
                )
            if par.recompute_full:  # not checked against a run
                if sp:
                    add("tp", "all_gather", "recomputed layer fwd", 2 * layers_here * mbs, act_sp, tpg, tp_inter)
                    add("tp", "reduce_scatter", "recomputed layer fwd", 2 * layers_here * mbs, act, tpg, tp_inter)
                else:
                    add("tp", "all_reduce", "recomputed layer fwd", 2 * layers_here * mbs, act, tpg, tp_inter)
            if first:
                if sp and model.position_embedding_type != "learned_absolute":
                    add("tp", "reduce_scatter", "embedding fwd", mbs, act, tpg, tp_inter)
                else:
                    add("tp", "all_reduce", "embedding fwd", mbs, act, tpg, tp_inter)
                if sp:
                    add("tp", "all_gather", "embedding bwd", mbs, act_sp, tpg, tp_inter)
            if last:
                if sp:
                    add("tp", "all_gather", "output layer fwd + bwd recompute", 2 * mbs, act_sp, tpg, tp_inter)
                    add("tp", "reduce_scatter", "output layer dgrad", mbs, act, tpg, tp_inter)
                else:
                    add("tp", "all_reduce", "output layer dgrad", mbs, act, tpg, tp_inter)
        if cp > 1:
            own = [(c * pp + e.pp_rank) * chunk_layers + i for c in range(vpp) for i in range(chunk_layers)]
            plan_cp(model, par, layout, e.rank, own, mbs, add, pb)
        if last:  # vocab-parallel cross-entropy: max, predicted logit, sum exp (unconditional)
            add("tp", "all_reduce", "cross-entropy (fp32 [s,b])", 3 * mbs, scalar, tpg, tp_inter)
        # parameters, per model chunk (each chunk has its own DDP buffers)
        chunks, moe_here = [], 0
        for c in range(vpp):
            vstage = c * pp + e.pp_rank
            moe_layers = model.moe_layers(vstage * chunk_layers, chunk_layers)
            moe_here += sum(moe_layers)
            experts = (local_experts, dims.expert_tp)
            chunks.append(
                _stage_params(model, tp, chunk_layers, vstage == 0, vstage == pp * vpp - 1, pp, moe_layers, experts)
            )
        # under EP > 1 the experts have a DDP buffer of their own, reduced over expert data parallel
        expert_chunks = [[p for p in ch if _is_expert(p[0])] for ch in chunks] if dims.ep > 1 else []
        chunks = [[p for p in ch if not _is_expert(p[0])] for ch in chunks] if dims.ep > 1 else chunks
        if sp:
            n = sum(numel for ch in chunks for name, numel in ch if _sp_marked(name))
            add("tp", "all_reduce", "SP norm/bias grads", 1, n * gb, tpg, tp_inter)
        # pipeline p2p (1F1B; interleaved: once per chunk boundary)
        if pp > 1:
            p2p = act_sp if sp else act
            nxt, prv = ppg[(e.pp_rank + 1) % pp], ppg[(e.pp_rank - 1) % pp]
            fwd_send = mbs * vpp - (mbs if last else 0)
            fwd_recv = mbs * vpp - (mbs if first else 0)
            add("pp", "send", "activations", fwd_send, p2p, [e.rank, nxt], layout.node_of(nxt) != e.node)
            add("pp", "recv", "activations", fwd_recv, p2p, [prv, e.rank], layout.node_of(prv) != e.node)
            add("pp", "send", "activation grads", fwd_recv, p2p, [e.rank, prv], layout.node_of(prv) != e.node)
            add("pp", "recv", "activation grads", fwd_send, p2p, [nxt, e.rank], layout.node_of(nxt) != e.node)
        # data parallel: DDP grad buffers
        shared = {"embedding.word_embeddings.weight", "output_layer.weight"} if model.tied and pp > 1 else set()
        if par.fsdp:
            plan_fsdp(par.fsdp, chunks, dp * cp, mbs, pb, gb, dpg, dp_inter, add, par.bucket_size)
        for c, ch in enumerate([] if par.fsdp else chunks):
            bsize = bucket_size if (par.overlap_grad_reduce and e.pp_rank == 0 and c == 0) else None
            bks = _buckets(ch, dp * cp, par.use_distributed_optimizer, bsize, shared)
            for b in bks:
                if par.use_distributed_optimizer:
                    add("dp_cp", "reduce_scatter", "grad buffer", 1, b * gb, dpg, dp_inter)
                    add("dp_cp", "all_gather", "param buffer shard", 1, b // (dp * cp) * pb, dpg, dp_inter)
                else:
                    add("dp_cp", "all_reduce", "grad buffer", 1, b * gb, dpg, dp_inter)
        if model.tied and pp > 1 and (first or last):
            eg = [ppg[0], ppg[-1]]
            add(
                "embd",
                "all_reduce",
                "tied embedding grad",
                1,
                model.padded_vocab(tp) // tp * model.hidden_size * gb,
                eg,
                layout.spans_nodes(eg),
            )
        if par.clip_grad > 0:
            if par.use_distributed_optimizer:
                # megatron's intra-distributed-optimizer-instance group: every rank, its own group object
                add("dist_opt", "all_reduce", "grad norm", 1, 4, list(range(layout.world_size)), layout.nnodes > 1)
            else:
                mpg = group("mp", e.rank)
                add("mp", "all_reduce", "grad norm", 1, 4, mpg, layout.spans_nodes(mpg))
            if par.fsdp == "torch_fsdp2" and len(dpg) > 1:
                # megatron-core sums the norm of DTensor gradients over their mesh's group first
                add("dp_cp", "all_reduce", "grad norm (DTensor shards)", 1, 4, dpg, dp_inter)
        if par.per_token_loss:
            if pp > 1:
                add("pp", "broadcast", "token count (per-token loss)", 1, 4, ppg, layout.spans_nodes(ppg))
            add("dp_cp", "all_reduce", "token count (per-token loss)", 1, 4, dpg, dp_inter)
        if moe:
            _plan_moe(model, par, dims, e.rank, moe_here, mbs, expert_chunks, bucket_size, group, add, layout)
        if par.loss_allreduce and last:  # over DP x CP (CP ranks hold parts of the same samples); DP without CP
            label = "dp_cp" if dims.cp > 1 else "dp"
            lg = group(label, e.rank)
            add(
                label,
                "all_reduce",
                "loss report (trainer: 'lm loss' as [sum, count])",
                1,
                8,
                lg,
                layout.spans_nodes(lg),
            )
        out.append(rp)
    return CommPlan(layout, model, par, out, intra_gbps, inter_gbps)


def _plan_moe(
    model: ModelSpec,
    par: ParallelSpec,
    dims: ParallelDims,
    rank: int,
    moe_here: int,
    mbs: int,
    expert_chunks: list[list[tuple[str, int]]],
    bucket_size: int,
    group: Callable[[str, int], list[int]],
    add: Callable[..., None],
    layout: RankMap,
) -> None:
    """One rank's MoE collectives (megatron-core 0.16.1, checked on an EP2 x DP2 run: tests/training/test_moe.py)."""
    pb, gb, sp = DTYPE_BYTES[model.params_dtype], model.grad_bytes(), par.sequence_parallel and dims.tp > 1
    calls = moe_here * mbs
    if dims.ep > 1 and model.moe_token_dispatcher_type == "alltoall":
        epg = group("ep", rank)
        # expert_all_to_all_bytes per call: [pairs, hidden] tokens 4x, [pairs] probabilities 2x
        pairs = model.micro_batch_size * model.seq_length // (dims.cp * (dims.tp if sp else 1)) * model.moe_router_topk
        inter = layout.spans_nodes(epg)
        what = "MoE tokens: dispatch, combine; fwd + bwd"
        add("ep", "all_to_all", what, 4 * calls, pairs * model.hidden_size * pb, epg, inter)
        add("ep", "all_to_all", "MoE routing probs: dispatch; fwd + bwd", 2 * calls, pairs * pb, epg, inter)
    if model.moe_token_dispatcher_type == "alltoall" and not model.moe_pad_expert_input_to_capacity:
        if dims.ep * dims.expert_tp > 1:  # the dispatcher's preprocess: every rank's [experts] counts
            g = group("tp_ep", rank)
            add(
                "tp_ep",
                "all_gather",
                "MoE tokens per expert (int64)",
                calls,
                model.num_experts * 8,
                g,
                layout.spans_nodes(g),
            )
    # the experts' DDP buffer (EP > 1), padded as the distributed optimizer pads it; under Megatron-FSDP
    # the experts' units, sharded over expert data parallel (counted: EP2 x DP4, optim_grads_params)
    edpg, edp = group("edp", rank), dims.expert_dp
    if par.fsdp and expert_chunks:
        inter = layout.spans_nodes(edpg)
        plan_fsdp(par.fsdp, expert_chunks, edp, mbs, pb, gb, edpg, inter, add, par.bucket_size, label="edp")
    for c, ch in enumerate([] if par.fsdp else expert_chunks):
        bsize = bucket_size if (par.overlap_grad_reduce and layout.ranks[rank].pp_rank == 0 and c == 0) else None
        for b in _buckets(ch, edp, par.use_distributed_optimizer, bsize, set()) if ch else []:
            inter = layout.spans_nodes(edpg)
            if par.use_distributed_optimizer:
                add("edp", "reduce_scatter", "expert grad buffer", 1, b * gb, edpg, inter)
                add("edp", "all_gather", "expert param buffer shard", 1, b // edp * pb, edpg, inter)
            else:
                add("edp", "all_reduce", "expert grad buffer", 1, b * gb, edpg, inter)
    if par.clip_grad > 0 and dims.ep > 1 and not par.use_distributed_optimizer:
        # the expert optimizer's own grad-stats group (the distributed optimizer shares dist_opt's)
        g = group("expert_mp", rank)
        add("expert_mp", "all_reduce", "expert grad norm", 1, 4, g, layout.spans_nodes(g))
    # the router's load-balancing token counts, reduced over TP x CP when that is > 1 (unchecked)
    tp_cp = group("tp_cp", rank)
    balancing = sum(1 for _, reduced in model.tracked_moe_losses() if reduced and _ != "z_loss")
    if len(tp_cp) > 1:
        what = "MoE aux loss: tokens per expert (int64)"
        add("tp_cp", "all_reduce", what, balancing * calls, model.num_experts * 8, tp_cp, layout.spans_nodes(tp_cp))
    # the trainer's MoE loss report: megatron-core's tracker, [num_layers] fp32 per loss, every iteration
    tracker = 4 * model.num_layers
    ppg, dg = group("pp", rank), group("dp", rank)
    for name, reduced in model.tracked_moe_losses():
        add("pp", "all_reduce", f"MoE tracker {name}", 1, tracker, ppg, layout.spans_nodes(ppg))
        if reduced and moe_here:  # the reduce group a MoE layer of this stage registered, then DP
            add("tp_cp", "all_reduce", f"MoE tracker {name}", 1, tracker, tp_cp, layout.spans_nodes(tp_cp))
            add("dp", "all_reduce", f"MoE tracker {name} (avg)", 1, tracker, dg, layout.spans_nodes(dg))


def main(argv: list[str] | None = None) -> int:
    """``megatron-npu plan`` (megatron_npu/layout/plan_cli.py)."""
    from megatron_npu.layout.plan_cli import main as plan_main

    return plan_main(argv)
