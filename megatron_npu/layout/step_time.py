"""A step-time model built from the layout: tokens/s per NPU and MFU for ``plan`` and ``plan --search``.

ASSUMPTIONS (printed with every prediction; a model to rank layouts and size jobs, not a measurement):

* matmul FLOPs (the linear layers, forward 2 x m x n x k, backward twice that) run at
  ``MATMUL_EFFICIENCY`` of the device's dense bf16 peak (PLANNING_FACTS: 910B 354 TFLOP/s);
* core attention (Q K^T and P V; causal: half the [s, s] products, a sliding window at most its
  width) at ``ATTENTION_EFFICIENCY`` of the peak (the fused flash-attention kernel's);
* full recompute runs each layer's forward again, selective recompute core attention's;
* the pipeline bubble: (PP - 1) / (VPP x micro-batches) of the compute (1F1B / interleaved);
* communication: the planner's wire bytes per rank (planner.py) at the link bandwidths (HCCS inside
  a node, RoCE between nodes): TP, CP, EP and pipeline traffic exposed (no TP comm overlap on
  Ascend), the data-parallel reduction and parameter gather hidden behind ``DP_OVERLAP`` of the
  compute (--overlap-grad-reduce / --overlap-param-gather), what exceeds it exposed.

MFU is Megatron-LM's: the model's FLOPs of one step without recompute (3 x forward) over the step
time and the world's peak. Compared with MindSpeed-LLM's published throughput in docs/planning.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_npu.accelerator.facts import PLANNING_FACTS
from megatron_npu.layout.model_spec import ModelSpec
from megatron_npu.layout.parallel_dims import ParallelDims
from megatron_npu.layout.planner import CommPlan
from megatron_npu.layout.stages import virtual_stage_layers

MATMUL_EFFICIENCY = 0.62  # of the bf16 peak for a transformer's GEMMs (ASSUMED for 910B)
ATTENTION_EFFICIENCY = 0.45  # of the bf16 peak for flash attention (ASSUMED for 910B)
DP_OVERLAP = 2 / 3  # the share of compute (the backward) that DP traffic hides behind


@dataclass(frozen=True)
class StepTime:
    """One step's predicted seconds (the slowest pipeline stage) and what follows from them."""

    matmul_s: float
    attention_s: float
    bubble_s: float
    exposed_comm_s: float
    tokens_per_step: int
    world_size: int
    model_flops: float  # one step, Megatron-LM's count (no recompute)

    @property
    def compute_s(self) -> float:
        return self.matmul_s + self.attention_s

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.exposed_comm_s

    @property
    def tokens_per_s_per_npu(self) -> float:
        return self.tokens_per_step / self.step_s / self.world_size

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_s * self.world_size * peak_flops())


def peak_flops() -> float:
    """The planning device's dense bf16 peak, FLOP/s."""
    return PLANNING_FACTS.peak_tflops_bf16.get(PLANNING_FACTS.device, 0.0) * 1e12


def assumptions() -> str:
    """The model's assumptions in one line, for every table that shows its figures."""
    return (
        f"step time ASSUMES {MATMUL_EFFICIENCY:.0%} (matmuls) / {ATTENTION_EFFICIENCY:.0%} (flash attention) of "
        f"{peak_flops() / 1e12:.0f} TFLOP/s bf16 per {PLANNING_FACTS.device}, the pipeline bubble, the planner's "
        f"bytes over {PLANNING_FACTS.intra_node_link} {PLANNING_FACTS.intra_node_gbps:g} / "
        f"{PLANNING_FACTS.inter_node_link} {PLANNING_FACTS.inter_node_gbps:g} GB/s, DP traffic hidden behind "
        f"{DP_OVERLAP:.0%} of compute (megatron_npu/layout/step_time.py)"
    )


def _attention_linear_flops(m: ModelSpec) -> float:
    """Forward FLOPs per token of one layer's attention projections."""
    h, heads = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        q_dim = m.qk_head_dim + m.qk_pos_emb_head_dim
        q = h * heads * q_dim if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank * heads * q_dim
        kv = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim)
        return 2 * (q + kv + heads * m.v_head_dim * h)
    shape = m.shape
    q, kv = heads * shape.kv_channels, shape.num_query_groups * shape.kv_channels
    return 2 * (h * (q + 2 * kv) + q * h)


def _core_attention_flops(m: ModelSpec, layer: int) -> float:
    """Forward FLOPs per token of core attention: Q K^T and P V over the keys a causal token sees on
    average (s / 2), or the sliding window's width where that is fewer (every layer but the
    --window-attn-skip-freq ones)."""
    heads = m.num_attention_heads
    _, qk, v = m.core_attention_heads
    keys = m.seq_length / 2
    if m.window_size is not None and not _full_attention_layer(m, layer):
        keys = min(keys, m.window_size[0] + 1)
    return 2 * heads * keys * (qk + v)


def _full_attention_layer(m: ModelSpec, layer: int) -> bool:
    freq = m.window_attn_skip_freq
    if freq is None:
        return False
    if isinstance(freq, int):
        return (layer + 1) % freq == 0
    return bool(freq[layer])


def _mlp_flops(m: ModelSpec, is_moe: bool) -> float:
    """Forward FLOPs per token of a layer's MLP (or its router, top-k experts and shared experts)."""
    h, mult = m.hidden_size, 3 if m.swiglu else 2
    if not is_moe:
        return 2 * mult * h * m.ffn
    shared = m.moe_shared_expert_intermediate_size or 0
    return 2 * h * (m.num_experts or 0) + 2 * mult * h * (m.moe_ffn * m.moe_router_topk + shared)


def layer_flops(m: ModelSpec, layer: int) -> tuple[float, float]:
    """(matmul, core attention) forward FLOPs per token of one decoder layer."""
    is_moe = m.moe_layers(layer, 1)[0]
    return _attention_linear_flops(m) + _mlp_flops(m, is_moe), _core_attention_flops(m, layer)


def model_flops(m: ModelSpec) -> float:
    """One step's FLOPs, forward and backward (3 x forward), no recompute: MFU's numerator."""
    per_token = sum(sum(layer_flops(m, i)) for i in range(m.num_layers)) + _output_flops(m)
    per_token += (m.mtp_num_layers or 0) * (sum(layer_flops(m, m.num_layers - 1)) + _output_flops(m))
    return 3 * per_token * m.global_batch_size * m.seq_length


def _output_flops(m: ModelSpec) -> float:
    return 2 * m.hidden_size * m.padded_vocab(1)


def step_time(model: ModelSpec, dims: ParallelDims, recompute: str | None, comm_s: float, dp_comm_s: float) -> StepTime:
    """The slowest stage's step: its FLOPs at the assumed efficiencies, the bubble, and the
    communication seconds the caller planned (``comm_s`` exposed, ``dp_comm_s`` overlappable)."""
    counts = virtual_stage_layers(dims, model.num_layers)
    pp, vpp = dims.pp, dims.virtual_stages
    tokens = model.global_batch_size * model.seq_length // dims.dp  # one data-parallel replica's
    shard = dims.tp * dims.cp  # what splits a layer's work inside a replica
    worst = (0.0, 0.0)
    for stage in range(pp):
        layers = [
            sum(counts[:v]) + i for v in range(stage, pp * vpp, pp) for i in range(counts[v])
        ]  # this stage's layer indices
        mm = sum(layer_flops(model, i)[0] for i in layers)
        attn = sum(layer_flops(model, i)[1] for i in layers)
        if stage == pp - 1:
            mm += _output_flops(model) * (1 + (model.mtp_num_layers or 0))
            mtp = model.mtp_num_layers or 0
            mm += mtp * layer_flops(model, model.num_layers - 1)[0]
            attn += mtp * layer_flops(model, model.num_layers - 1)[1]
        passes_mm = 4 if recompute == "full" else 3
        passes_attn = 4 if recompute in ("full", "selective") else 3
        mm_s = passes_mm * mm * tokens / shard / (peak_flops() * MATMUL_EFFICIENCY)
        attn_s = passes_attn * attn * tokens / shard / (peak_flops() * ATTENTION_EFFICIENCY)
        if mm_s + attn_s > sum(worst):
            worst = (mm_s, attn_s)
    compute = sum(worst)
    microbatches = model.global_batch_size // (model.micro_batch_size * dims.dp)
    bubble = compute * (pp - 1) / (vpp * microbatches)
    exposed = comm_s + max(0.0, dp_comm_s - DP_OVERLAP * compute)
    return StepTime(
        matmul_s=worst[0],
        attention_s=worst[1],
        bubble_s=bubble,
        exposed_comm_s=exposed,
        tokens_per_step=model.global_batch_size * model.seq_length,
        world_size=dims.world_size,
        model_flops=model_flops(model),
    )


DP_LABELS = ("dp_cp", "edp")  # the data-parallel reductions and gathers: overlappable with compute


def comm_seconds(result: CommPlan) -> tuple[float, float]:
    """(exposed, data-parallel) communication seconds of the slowest pipeline stage's first rank: the
    planner's wire bytes at its bandwidths."""
    per_stage = result.layout.world_size // result.layout.dims.pp
    worst = (0.0, 0.0)
    for stage in range(result.layout.dims.pp):
        groups = result.ranks[stage * per_stage].by_label()
        secs = {
            k: v["wire_intra"] / (result.intra_gbps * 1e9) + v["wire_inter"] / (result.inter_gbps * 1e9)
            for k, v in groups.items()
        }
        dp = sum(v for k, v in secs.items() if k in DP_LABELS)
        exposed = sum(v for k, v in secs.items() if k not in DP_LABELS)
        if exposed + dp > sum(worst):
            worst = (exposed, dp)
    return worst
