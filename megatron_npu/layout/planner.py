"""Communication planner: what each rank passes to torch.distributed per training iteration.

The model description: model_spec.py; memory: memory.py; the ``megatron-npu plan`` command (and --search)
above this library: megatron_npu/plan/.

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
from megatron_npu.layout.model_spec import DTYPE_BYTES, ModelSpec, holds_final_norm, is_expert, stage_params
from megatron_npu.layout.parallel_dims import ParallelDims
from megatron_npu.layout.plan_cp_fsdp import plan_cp, plan_fsdp
from megatron_npu.layout.rankmap import RankMap, cp_placement
from megatron_npu.layout.stages import chunk_layers

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
    """Every rank's calls for one iteration: the layout's rules checked, then each rank's steps."""
    par, mbs = _checked(model, layout, parallel or ParallelSpec())
    ranks = [_RankSteps(model, par, layout, entry.rank, mbs).run() for entry in layout.ranks]
    return CommPlan(layout, model, par, ranks, intra_gbps, inter_gbps)


def _checked(model: ModelSpec, layout: RankMap, par: ParallelSpec) -> tuple[ParallelSpec, int]:
    """The layout's rules for this model (ParallelDims), and the settings megatron-core derives: SP is
    off at TP 1. Returns the settings and the micro-batches per iteration."""
    dims = layout.dims
    dims.check_num_layers(model.num_layers)
    dims.check_seq_length(model.seq_length, par.sequence_parallel)
    mbs = dims.microbatches(model.global_batch_size, model.micro_batch_size)
    if par.sequence_parallel and dims.tp == 1:
        par = ParallelSpec(**(asdict(par) | {"sequence_parallel": False}))
    return par, mbs


class _RankSteps:
    """One rank's calls, step by step in the order megatron-core makes them in one iteration."""

    def __init__(self, model: ModelSpec, par: ParallelSpec, layout: RankMap, rank: int, mbs: int) -> None:
        self.model, self.par, self.layout, self.dims, self.mbs = model, par, layout, layout.dims, mbs
        entry = layout.ranks[rank]
        self.rank, self.pp_rank = rank, entry.pp_rank
        self.rp = RankPlan(rank, entry.node, entry.pp_rank)
        self.tpg, self.ppg, self.dpg = self.group("tp"), self.group("pp"), self.group("dp_cp")
        self.tp_inter, self.dp_inter = layout.spans_nodes(self.tpg), layout.spans_nodes(self.dpg)
        self.first, self.last = entry.pp_rank == 0, entry.pp_rank == self.dims.pp - 1
        self.pb, self.gb = DTYPE_BYTES[model.params_dtype], model.grad_bytes()
        self.act = model.seq_length // self.dims.cp * model.micro_batch_size * model.hidden_size * self.pb  # [s, b, h]
        self.sp = par.sequence_parallel
        self.chunks = chunk_layers(self.dims, model.num_layers, entry.pp_rank)  # (first layer, count) per chunk
        self.bucket_size = par.bucket_size or max(40_000_000, 1_000_000 * self.dims.dp * self.dims.cp)

    def group(self, name: str, rank: int | None = None) -> list[int]:
        rank = self.rank if rank is None else rank
        return next(g for g in self.layout.groups[name] if rank in g)

    def add(self, label: str, op: str, what: str, calls: int, payload: int, g: list[int], inter: bool) -> None:
        if calls:
            self.rp.items.append(Item(label, op, what, calls, payload, len(g), inter))

    def run(self) -> RankPlan:
        self.tensor_parallel()
        self.context_parallel()
        self.cross_entropy()
        chunks, expert_chunks, moe_here = self.parameters()
        self.sequence_parallel_grads(chunks)
        self.pipeline_p2p()
        self.gradient_buffers(chunks)
        self.tied_embedding_grad()
        self.grad_norm()
        self.per_token_loss()
        if self.model.num_experts:
            _plan_moe(
                self.model,
                self.par,
                self.dims,
                self.rank,
                moe_here,
                self.mbs,
                expert_chunks,
                self.bucket_size,
                self.group,
                self.add,
                self.layout,
            )
        self.loss_report()
        return self.rp

    def tensor_parallel(self) -> None:
        """Per micro-batch: the layers' row / column-parallel reductions (or SP's gathers and scatters),
        the recomputed forward, the embedding's and the output layer's."""
        if self.dims.tp == 1:
            return
        act, act_sp, mbs, sp = self.act, self.act // self.dims.tp, self.mbs, self.sp
        # MTP layers on the last stage: a transformer layer's traffic each (unchecked)
        layers = (sum(n for _, n in self.chunks) + (self.model.mtp_num_layers or 0) * self.last) * mbs
        tp = (self.tpg, self.tp_inter)
        if sp:
            self.add("tp", "all_gather", "layers: qkv/fc1 fwd + bwd recompute, proj/fc2 bwd", 6 * layers, act_sp, *tp)
            self.add("tp", "reduce_scatter", "layers: proj/fc2 fwd, qkv/fc1 dgrad", 4 * layers, act, *tp)
        else:
            self.add("tp", "all_reduce", "layers: proj/fc2 fwd, qkv/fc1 dgrad", 4 * layers, act, *tp)
        if self.par.recompute_full:  # not checked against a run
            if sp:
                self.add("tp", "all_gather", "recomputed layer fwd", 2 * layers, act_sp, *tp)
                self.add("tp", "reduce_scatter", "recomputed layer fwd", 2 * layers, act, *tp)
            else:
                self.add("tp", "all_reduce", "recomputed layer fwd", 2 * layers, act, *tp)
        if self.first:
            if sp and self.model.position_embedding_type != "learned_absolute":
                self.add("tp", "reduce_scatter", "embedding fwd", mbs, act, *tp)
            else:
                self.add("tp", "all_reduce", "embedding fwd", mbs, act, *tp)
            if sp:
                self.add("tp", "all_gather", "embedding bwd", mbs, act_sp, *tp)
        if self.last:
            if sp:
                self.add("tp", "all_gather", "output layer fwd + bwd recompute", 2 * mbs, act_sp, *tp)
                self.add("tp", "reduce_scatter", "output layer dgrad", mbs, act, *tp)
            else:
                self.add("tp", "all_reduce", "output layer dgrad", mbs, act, *tp)

    def context_parallel(self) -> None:
        """CP attention's K/V traffic per layer this rank holds (plan_cp_fsdp.py)."""
        if self.dims.cp == 1:
            return
        own = [start + i for start, n in self.chunks for i in range(n)]
        plan_cp(self.model, self.par, self.layout, self.rank, own, self.mbs, self.add, self.pb)

    def cross_entropy(self) -> None:
        """The vocab-parallel cross-entropy's max, predicted logit and sum of exps (called even at TP 1)."""
        if self.last:
            scalar = self.model.seq_length // self.dims.cp * self.model.micro_batch_size * 4  # fp32 [s, b]
            self.add("tp", "all_reduce", "cross-entropy (fp32 [s,b])", 3 * self.mbs, scalar, self.tpg, self.tp_inter)

    def parameters(self) -> tuple[list[list[tuple[str, int]]], list[list[tuple[str, int]]], int]:
        """(dense parameters per model chunk, expert parameters per chunk under EP > 1, MoE layers here):
        each chunk has its own DDP buffers, and under EP > 1 the experts one of their own."""
        model, dims, pp = self.model, self.dims, self.dims.pp
        experts = ((model.num_experts or 0) // dims.ep, dims.expert_tp)
        chunks, moe_here = [], 0
        for c, (start, n) in enumerate(self.chunks):
            vstage = c * pp + self.pp_rank
            moe_layers = model.moe_layers(start, n)
            moe_here += sum(moe_layers)
            last = vstage == pp * dims.virtual_stages - 1
            norm = holds_final_norm(model, start, n, last)
            chunks.append(stage_params(model, dims.tp, n, vstage == 0, last, pp, moe_layers, experts, norm))
        if dims.ep == 1:
            return chunks, [], moe_here
        experts_only = [[p for p in ch if is_expert(p[0])] for ch in chunks]
        return [[p for p in ch if not is_expert(p[0])] for ch in chunks], experts_only, moe_here

    def sequence_parallel_grads(self, chunks: list[list[tuple[str, int]]]) -> None:
        """The SP-marked parameters' gradients (norms, row-parallel biases, router), all-reduced over TP."""
        if self.sp:
            n = sum(numel for ch in chunks for name, numel in ch if _sp_marked(name))
            self.add("tp", "all_reduce", "SP norm/bias grads", 1, n * self.gb, self.tpg, self.tp_inter)

    def pipeline_p2p(self) -> None:
        """1F1B p2p: one activation and one gradient per micro-batch per boundary (interleaved: per chunk)."""
        pp = self.dims.pp
        if pp == 1:
            return
        p2p = self.act // self.dims.tp if self.sp else self.act
        vpp, mbs, node_of = self.dims.virtual_stages, self.mbs, self.layout.node_of
        nxt, prv = self.ppg[(self.pp_rank + 1) % pp], self.ppg[(self.pp_rank - 1) % pp]
        to_next, to_prev = node_of(nxt) != self.rp.node, node_of(prv) != self.rp.node
        fwd_send = mbs * vpp - (mbs if self.last else 0)
        fwd_recv = mbs * vpp - (mbs if self.first else 0)
        self.add("pp", "send", "activations", fwd_send, p2p, [self.rank, nxt], to_next)
        self.add("pp", "recv", "activations", fwd_recv, p2p, [prv, self.rank], to_prev)
        self.add("pp", "send", "activation grads", fwd_recv, p2p, [self.rank, prv], to_prev)
        self.add("pp", "recv", "activation grads", fwd_send, p2p, [nxt, self.rank], to_next)

    def gradient_buffers(self, chunks: list[list[tuple[str, int]]]) -> None:
        """DDP's per-bucket reduction of the dense grad buffers over DP x CP (FSDP: its units)."""
        par, dp_cp, pb, gb = self.par, self.dims.dp * self.dims.cp, self.pb, self.gb
        dp = (self.dpg, self.dp_inter)
        if par.fsdp:
            plan_fsdp(par.fsdp, chunks, dp_cp, self.mbs, pb, gb, *dp, self.add, par.bucket_size)
            return
        shared = {"embedding.word_embeddings.weight", "output_layer.weight"} if self._tied_across_stages else set()
        for c, ch in enumerate(chunks):
            bsize = self.bucket_size if (par.overlap_grad_reduce and self.pp_rank == 0 and c == 0) else None
            for b in _buckets(ch, dp_cp, par.use_distributed_optimizer, bsize, shared):
                if par.use_distributed_optimizer:
                    self.add("dp_cp", "reduce_scatter", "grad buffer", 1, b * gb, *dp)
                    self.add("dp_cp", "all_gather", "param buffer shard", 1, b // dp_cp * pb, *dp)
                else:
                    self.add("dp_cp", "all_reduce", "grad buffer", 1, b * gb, *dp)

    @property
    def _tied_across_stages(self) -> bool:
        return self.model.tied and self.dims.pp > 1

    def tied_embedding_grad(self) -> None:
        """The tied embedding's gradient, all-reduced between the first and the last stage."""
        if self._tied_across_stages and (self.first or self.last):
            eg = [self.ppg[0], self.ppg[-1]]
            payload = self.model.padded_vocab(self.dims.tp) // self.dims.tp * self.model.hidden_size * self.gb
            self.add("embd", "all_reduce", "tied embedding grad", 1, payload, eg, self.layout.spans_nodes(eg))

    def grad_norm(self) -> None:
        """The 1-float grad-norm all-reduce: every rank under the distributed optimizer (megatron's
        intra-distributed-optimizer-instance group, its own group object), else model parallel."""
        if self.par.clip_grad <= 0:
            return
        if self.par.use_distributed_optimizer:
            world = list(range(self.layout.world_size))
            self.add("dist_opt", "all_reduce", "grad norm", 1, 4, world, self.layout.nnodes > 1)
        else:
            mpg = self.group("mp")
            self.add("mp", "all_reduce", "grad norm", 1, 4, mpg, self.layout.spans_nodes(mpg))
        if self.par.fsdp == "torch_fsdp2" and len(self.dpg) > 1:
            # megatron-core sums the norm of DTensor gradients over their mesh's group first
            self.add("dp_cp", "all_reduce", "grad norm (DTensor shards)", 1, 4, self.dpg, self.dp_inter)

    def per_token_loss(self) -> None:
        """--calculate-per-token-loss: the token count, broadcast over PP and all-reduced over DP x CP."""
        if not self.par.per_token_loss:
            return
        if self.dims.pp > 1:
            self.add(
                "pp", "broadcast", "token count (per-token loss)", 1, 4, self.ppg, self.layout.spans_nodes(self.ppg)
            )
        self.add("dp_cp", "all_reduce", "token count (per-token loss)", 1, 4, self.dpg, self.dp_inter)

    def loss_report(self) -> None:
        """The trainer's 'lm loss' [sum, count] on the last stage, over DP x CP (CP ranks hold parts of
        the same samples); DP without CP."""
        if self.par.loss_allreduce and self.last:
            label = "dp_cp" if self.dims.cp > 1 else "dp"
            lg = self.group(label)
            what = "loss report (trainer: 'lm loss' as [sum, count])"
            self.add(label, "all_reduce", what, 1, 8, lg, self.layout.spans_nodes(lg))


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
