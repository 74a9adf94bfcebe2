"""Per-rank memory model: the bytes one rank holds for a training step, by pipeline stage.

From the trainer's settings (pretrain_gpt.py's flags, or args.json) or a Hugging Face config through
the converter's mapping; no torch import. Parameter lists come from the communication planner
(``model_spec.stage_params``: names and sizes in megatron-core's ``named_parameters()`` order), and
bucket layout from the same megatron-core ``_ParamAndGradBuffer`` rules (``bucket_layout``).

What is counted, and how it was checked (tests/layout/test_memory_model.py, cpu target, megatron-core
0.16.1, local spec; measured by megatron_npu.training.memory_report):

* **parameters**: each rank's parameters in the params dtype; under the distributed optimizer
  megatron-core's param buffer (padding included, as its buffer pads). Exact.
* **gradients**: DDP's ``main_grad`` buffers, fp32 for bf16 (``--accumulate-allreduce-grads-in-fp32``,
  Megatron-LM's default for bf16) else the params dtype; padded under the distributed optimizer
  (params start at multiples of 64, buckets end at multiples of lcm(DP, 128)). Exact.
* **optimizer state**: Adam's two fp32 moments, plus an fp32 master copy for bf16 / fp16 params;
  under the distributed optimizer only this rank's shard of each bucket (the parameter elements in it:
  padding has no state). Adam's per-parameter ``step`` scalars are not counted. Exact.
* **activations saved for backward**, per micro-batch of each model chunk, by layer type (bytes
  autograd holds, each storage once): embedding (token ids, the vocab-parallel mask, position ids),
  per transformer layer the two norms (input, fp32 mean and rstd; RMSNorm: input and fp32 rstd),
  QKV input and output, core attention (unfused: the [b, heads/TP, s, s] softmax output in fp32
  and the probabilities in the params dtype when they differ, the causal mask; fused / flash
  attention: the output and the fp32 log-sum-exp), the projection input, MLP or SwiGLU (fc1 input,
  fc1 output, fc2 input), MoE (router input and logits, the permuted tokens at the dropless upper
  bound of tokens x top-k per rank, or at capacity, the experts' fc1 / fc2 activations), the final
  norm, the output layer input and the cross-entropy's fp32 softmax, target mask and ids. Under
  sequence parallelism the norm and linear inputs are the sequence shard (the gather runs again in
  backward). MLA (``_mla_projections``): the compressed q / kv through their norms, RoPE's cos and sin,
  the assembled q, k, v; an MTP layer (``_mtp_layer``) on the last chunk; learnable / off-by-one softmax
  sinks one more softmax column. Within 5% of measured per rank for every layout of the tests (dense,
  MoE, MLA + MTP, sliding windows with sinks, uneven stages and a pipeline layout; most within 2%).
* **micro-batches in flight**: 1F1B keeps min(PP - stage, M) micro-batches' activations; the
  interleaved schedule is simulated as megatron-core orders it (warm-up (PP - stage - 1) x 2 +
  (VPP - 1) x PP forwards, chunks in groups of PP micro-batches). Full recompute keeps each
  recomputed unit's input and, while one unit runs backward, its full activations; selective
  recompute drops core attention's activations (recomputed from Q, K, V). Checked as the measured
  peak of saved bytes alive at once. A later pipeline stage holds one received [s, b, h] activation
  more (``_received_input``, measured; it had left those stages up to 4.9% low); the dropless MoE bound
  is 56-70% above a random routing's bytes.

Context parallelism (sequence terms / CP; core attention as the CP attention saves it: q, k, v, output,
fp32 row statistics, and no QKV output): within 0.05% of benchmarks/cp_memory.py's saved bytes less the
weights at CP2 and CP4, p2p and a2a. FSDP (parameters, gradients and optimizer state per rank by
sharding strategy, fsdp_comm.state_bytes_per_rank, at rest: without Megatron-FSDP's gathered working
set): within 0.1% of benchmarks/fsdp_memory.py's measured bytes for every strategy at DP 1, 2, 4.

Dropout (hidden, attention, embedding > 0): each dropout saves its mask, ``dropout_mask_bytes`` per
element: torch's fused kernel (CUDA and out-of-tree devices) a bool mask, 1 byte, the planner's
assumption; the cpu target's unfused dropout the scaled noise in the activations' dtype; the trainer's
``--memory-report`` measures the device's own (training/memory_report.py). Checked with dropout 0.1 on
the MoE layouts of issue 35 (at capacity, tokens dropped by probability: the model had left out the
float masks and the embedding's dropout, -9% per rank, -11% under full recompute; after: within 5%).
Modelled, not measured: FSDP's gathered units on top of the state, the allocator's fragmentation and workspace, the communication buffers, torch_npu's own reserve (the planner's
headroom covers them). Bytes are exact counts of what megatron-core allocates; the device's
caching allocator rounds each block up (512 B on NPU / CUDA) and holds freed blocks.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from megatron_npu.layout.buckets import Bucket, bucket_layout
from megatron_npu.layout.fsdp_comm import state_bytes_per_rank
from megatron_npu.layout.model_shape import ModelShape
from megatron_npu.layout.model_spec import DTYPE_BYTES, ModelSpec, holds_final_norm, is_expert, stage_params
from megatron_npu.layout.parallel_dims import ParallelDims, arg_value
from megatron_npu.layout.plan_cp_fsdp import fsdp_scheme
from megatron_npu.layout.stages import chunk_layers

# ---- settings --------------------------------------------------------------------------------


@dataclass
class MemorySettings:
    """The training settings the bytes depend on, named as Megatron-LM's flags."""

    use_distributed_optimizer: bool = False
    sequence_parallel: bool = False
    overlap_grad_reduce: bool = False
    bucket_size: int | None = None
    recompute_granularity: str | None = None  # full | selective
    recompute_method: str | None = None  # uniform | block
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] = ("core_attn",)
    fused_attention: bool = False  # --use-flash-attn on a device with a fused kernel
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    dropout_mask_bytes: float = 1.0  # per element: a fused kernel's bool mask (the cpu target: the dtype's)
    fp16_lm_cross_entropy: bool = False
    attention_softmax_in_fp32: bool = False
    fused_rms_norm: bool = False  # the device's fused RMSNorm (input + fp32 rstd) instead of the torch twin
    optimizer: str = "adam"
    fsdp_strategy: str | None = None  # a Megatron-FSDP sharding strategy or torch_fsdp2 (plan_cp_fsdp.fsdp_scheme)
    microbatch_group_size_per_vp_stage: int | None = None  # None: PP (megatron-core's default)


@dataclass
class RankMemory:
    """One rank's predicted bytes."""

    rank: int
    pp_rank: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    saved_per_microbatch: dict[int, int]  # model chunk -> bytes one micro-batch saves
    saved_by_type: dict[str, int]  # layer type -> bytes per micro-batch (all chunks of this rank)
    in_flight: dict[int, int]  # model chunk -> micro-batches alive at the peak
    saved_peak_bytes: int

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.saved_peak_bytes

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["saved_per_microbatch"] = {str(k): v for k, v in self.saved_per_microbatch.items()}
        out["in_flight"] = {str(k): v for k, v in self.in_flight.items()}
        return out | {"state_bytes": self.state_bytes, "total_bytes": self.total_bytes}


# ---- parameters, gradients, optimizer state -------------------------------------------------------


def _shard_elements(buckets: list[Bucket], dp: int, dp_rank: int) -> int:
    """Parameter elements in this DP rank's shard of each bucket (the distributed optimizer's range)."""
    total = 0
    for b in buckets:
        size = (b.end - b.start) // dp
        lo, hi = b.start + dp_rank * size, b.start + (dp_rank + 1) * size
        total += sum(max(0, min(hi, e) - max(lo, s)) for _, s, e in b.params)
    return total


def _state_bytes(
    model: ModelSpec, st: MemorySettings, buffers: list[tuple[list[tuple[str, int]], int, int, bool, set]]
) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes of DDP buffers given as (params, dp size, dp rank, bucketed, shared)."""
    pb, gb = DTYPE_BYTES[model.params_dtype], model.grad_bytes()
    master = 4 if model.params_dtype != "fp32" else 0  # an fp32 model's master copy is the parameter
    moments = 8 if st.optimizer == "adam" else 4  # Adam: exp_avg, exp_avg_sq; SGD: momentum
    if st.fsdp_strategy is not None:
        return _fsdp_state_bytes(model, st.fsdp_strategy, moments, buffers)
    dist_opt = st.use_distributed_optimizer
    param_bytes = grad_bytes = opt_bytes = 0
    bucket_size = st.bucket_size
    for params, dp, dp_rank, bucketed, shared in buffers:
        if not params:
            continue
        size = (bucket_size or max(40_000_000, 1_000_000 * dp)) if bucketed else None
        buckets = bucket_layout(params, dp, dist_opt, size, shared)
        numel = buckets[-1].end
        count = sum(n for _, n in params)
        shard = _shard_elements(buckets, dp, dp_rank) if dist_opt else count
        param_bytes += (numel if dist_opt else count) * pb
        grad_bytes += numel * gb
        opt_bytes += shard * (master + moments)
    return param_bytes, grad_bytes, opt_bytes


def _fsdp_state_bytes(
    model: ModelSpec, strategy: str, moments: int, buffers: list[tuple[list[tuple[str, int]], int, int, bool, set]]
) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes under FSDP: fsdp_comm.state_bytes_per_rank of each buffer's
    parameters over its data-parallel (x CP) group; the fp32 main weights count as optimizer state.
    ``moments``: the optimizer's bytes per element (_state_bytes')."""
    totals = [0, 0, 0]
    for params, dp, _, _, _ in buffers:
        if params:
            state = state_bytes_per_rank(
                sum(n for _, n in params),
                dp,
                strategy,
                DTYPE_BYTES[model.params_dtype],
                model.grad_bytes(),
                moment_bytes=moments,
            )
            for i, key in enumerate(("params", "grads", "optimizer")):
                totals[i] += state[key]
    return totals[0], totals[1], totals[2]


def _rank_buffers(
    model: ModelSpec, st: MemorySettings, dims: ParallelDims, rank_coords: dict[str, int]
) -> tuple[list, list[list[tuple[str, int]]], list[list[bool]]]:
    """This rank's DDP buffers (one dense and, under EP > 1, one expert buffer per model chunk), its
    chunks' parameter lists and their MoE-layer patterns."""
    pp, vpp = dims.pp, dims.virtual_stages
    local_experts = (model.num_experts or 0) // dims.ep
    shared = {"embedding.word_embeddings.weight", "output_layer.weight"} if model.tied and pp > 1 else set()
    buffers, chunks, patterns = [], [], []
    for c, (start, count) in enumerate(chunk_layers(dims, model.num_layers, rank_coords["pp"])):
        vstage = c * pp + rank_coords["pp"]
        moe, last = model.moe_layers(start, count), vstage == pp * vpp - 1
        experts = (local_experts, dims.expert_tp)
        norm = holds_final_norm(model, start, count, last)
        params = stage_params(model, dims.tp, count, vstage == 0, last, pp, moe, experts, norm)
        chunks.append(params)
        patterns.append(moe)
        bucketed = st.overlap_grad_reduce and rank_coords["pp"] == 0 and c == 0
        if dims.ep > 1:
            dense = [p for p in params if not is_expert(p[0])]
            experts = [p for p in params if is_expert(p[0])]
            buffers.append((dense, dims.dp_cp, rank_coords["dp_cp"], bucketed, shared))
            buffers.append((experts, dims.expert_dp, rank_coords["edp"], bucketed, set()))
        else:
            buffers.append((params, dims.dp_cp, rank_coords["dp_cp"], bucketed, shared))
    return buffers, chunks, patterns


# ---- activations ---------------------------------------------------------------------------------


def _norm(model: ModelSpec, st: MemorySettings, tokens: int, h: int, act: int) -> int:
    """A norm's saved tensors. LayerNorm (torch's kernel): input, mean and rstd in the activations'
    dtype. RMSNorm: this project's torch twin computes in fp32 (the fp32 input, rstd and the
    normalized input for the weight's gradient); a fused kernel (``fused_rms_norm``) saves the input
    and an fp32 rstd."""
    if model.normalization != "RMSNorm":
        return tokens * h * act + 2 * tokens * act
    if st.fused_rms_norm:
        return tokens * h * act + tokens * 4
    return 2 * tokens * h * 4 + tokens * 4


def _attention(model: ModelSpec, st: MemorySettings, dims: ParallelDims, act: int) -> dict[str, int]:
    """One layer's attention: norm, QKV input and output, core attention, projection input."""
    shape, tp, b = model.shape, dims.tp, model.micro_batch_size
    s = model.seq_length // dims.cp
    sp = st.sequence_parallel and tp > 1
    tokens, shard = s * b, s * b // (tp if sp else 1)
    heads = shape.num_attention_heads // tp
    q = v_out = heads * shape.kv_channels
    kv = shape.num_query_groups // tp * shape.kv_channels if shape.num_query_groups >= tp else shape.kv_channels
    qkv_out = tokens * (q + 2 * kv) * act
    rope = model.position_embedding_type in ("rope", "yarn")  # YaRN rotates as RoPE, its mscale in cos / sin
    out = {"norm": _norm(model, st, shard, model.hidden_size, act), "qkv_in": shard * model.hidden_size * act}
    if model.multi_latent_attention:
        # MLA: q and k carry qk_head_dim + the RoPE part, v its own head size (core attention below)
        q, kv = heads * (model.qk_head_dim + model.qk_pos_emb_head_dim), heads * model.v_head_dim
        v_out = kv
        out["qkv_out"] = _mla_projections(model, st, dims, heads, act)
        qkv_out, rope = 0, False
    # RoPE writes new Q and K (the V view keeps the fused QKV output alive) and saves a cos and a sin
    # ([s, 1, 1, d], made anew per call) for each
    if not model.multi_latent_attention:
        out["qkv_out"] = qkv_out + (tokens * (q + kv) * act + 4 * s * shape.kv_channels * act if rope else 0)
    selective = st.recompute_granularity == "selective" and "core_attn" in st.recompute_modules
    if dims.cp > 1 and not selective:
        # the CP attention (ops/context_parallel.py) saves its own contiguous q, k, v (after an all-to-all
        # the head-split copies, as many elements), its output and the fp32 row max and sum; no [s, s]
        # scores. Nothing then keeps the QKV output or RoPE's new Q and K, only RoPE's cos and sin for q
        # and for k. Measured: benchmarks/cp_memory.py.
        out["qkv_out"] = 4 * s * shape.kv_channels * act if rope else 0
        out["core_attn"] = tokens * (2 * q + 2 * kv) * act + 2 * b * heads * s * 4
    elif st.fused_attention:
        out["core_attn"] = tokens * v_out * act + b * heads * s * 4  # output and fp32 log-sum-exp
    elif selective:
        out["core_attn"] = 0  # recomputed from Q, K, V in backward
    else:
        scores = b * heads * s * s
        out["core_attn"] = scores * act + s * s  # softmax output, causal (or sliding-window) mask (bool)
        if model.softmax_type != "vanilla":
            out["core_attn"] += b * heads * s * act  # SoftmaxOne's softmax runs over one more column, the sink
        if st.attention_softmax_in_fp32 and act != 4:
            out["core_attn"] += scores * 4  # the fp32 softmax output besides the probabilities cast back
        if st.attention_dropout > 0:
            out["core_attn"] += int(scores * (st.dropout_mask_bytes + act))  # dropout mask and output
    out["proj_in"] = tokens * v_out * act
    if st.hidden_dropout > 0:
        out["dropout"] = int(2 * shard * model.hidden_size * st.dropout_mask_bytes)  # two bias-dropout-add masks
    return out


def _mla_projections(model: ModelSpec, st: MemorySettings, dims: ParallelDims, heads: int, act: int) -> int:
    """MLA's projections (megatron-core 0.16.1's MLASelfAttention, local spec), beyond the input the down
    projections share: each compressed path (q's with --q-lora-rank; kv's), RoPE's cos and sin, and the q,
    k, v core attention receives. The up projections' outputs are not saved: q and k are split from them
    and concatenated anew with their RoPE parts (RoPE's multiplies save only cos and sin), v is copied
    contiguous. Measured on the cpu target (tests/layout/test_memory_model.py)."""
    tp, b, s = dims.tp, model.micro_batch_size, model.seq_length // dims.cp
    tokens = s * b
    shard = tokens // (tp if st.sequence_parallel and tp > 1 else 1)
    pos, v_dim = model.qk_pos_emb_head_dim, model.v_head_dim
    kv_width = model.kv_lora_rank + pos  # k's RoPE part comes out of the same down projection
    out = _mla_compressed(model, st, tokens, shard, model.kv_lora_rank, kv_width, act)
    if model.q_lora_rank is not None:  # without it linear_q_proj reads the attention input, counted already
        out += _mla_compressed(model, st, tokens, shard, model.q_lora_rank, model.q_lora_rank, act)
    rope = 4 * s * pos * act  # cos and sin ([s, 1, 1, pos], the activations' dtype) for q's part and k's
    assembled = tokens * heads * (2 * (model.qk_head_dim + pos) + v_dim) * act  # core attention's q, k, v
    return out + rope + assembled


def _mla_compressed(
    model: ModelSpec, st: MemorySettings, tokens: int, shard: int, width: int, stored: int, act: int
) -> int:
    """One compressed MLA path: the down projection's output (``stored`` wide; under TP gathered over the
    whole sequence, and under SP its sequence shard a view of that gathered tensor) read by the q / kv
    norm, or by the up projection without --qk-layernorm, then the norm's statistics and the up
    projection's input (``width`` wide, this rank's tokens)."""
    whole = tokens * stored * act
    if not model.qk_layernorm:
        return whole  # the up projection saves its input, a view of the down projection's output
    if model.normalization != "RMSNorm":
        norm = whole + 2 * shard * act  # torch's layer_norm: the input's storage, mean and rstd
    elif st.fused_rms_norm:
        norm = whole + shard * 4  # the input and an fp32 rstd
    else:
        # torch's rms_norm computes in fp32: an fp32 input is saved itself (its whole storage), a lower
        # precision one as its fp32 copy; then the fp32 rstd and normalized input
        norm = (whole if act == 4 else shard * width * 4) + shard * 4 + shard * width * 4
    return norm + shard * width * act


def _mlp(model: ModelSpec, st: MemorySettings, dims: ParallelDims, act: int) -> dict[str, int]:
    """A dense MLP: norm, fc1 input, fc1 output (the activation's input), fc2 input."""
    tp, b, s = dims.tp, model.micro_batch_size, model.seq_length // dims.cp
    sp = st.sequence_parallel and tp > 1
    tokens, shard, ffn = s * b, s * b // (tp if sp else 1), model.ffn // tp
    return {
        "norm": _norm(model, st, shard, model.hidden_size, act),
        "fc1_in": shard * model.hidden_size * act,
        # SwiGLU: fc1's [gate, value] output, silu(gate) and its product's other factor
        "fc1_out": tokens * ffn * (4 if model.swiglu else 1) * act,
        "fc2_in": tokens * ffn * act,
    }


def _moe(model: ModelSpec, st: MemorySettings, dims: ParallelDims, act: int, capacity: float | None) -> dict[str, int]:
    """An MoE layer (alltoall dispatcher, SequentialMLP experts): norm, router, permutation indices,
    the tokens this rank's experts receive and their activations, shared experts."""
    tp, b, s = dims.tp, model.micro_batch_size, model.seq_length // dims.cp
    sp = st.sequence_parallel and tp > 1
    shard, h, k, e = s * b // (tp if sp else 1), model.hidden_size, model.moe_router_topk, model.num_experts or 0
    local, sources = e // dims.ep, dims.ep * dims.expert_tp  # tokens come from every rank of expert TP x EP
    if capacity is None:  # dropless: the upper bound, every source's tokens routed to this rank's experts
        routed = shard * sources * min(k, local)
    else:  # each source sends at most its capacity to each expert
        routed = math.ceil(capacity * shard * k / e) * local * sources
    ffn = model.moe_ffn // dims.expert_tp
    out = {
        "norm": _norm(model, st, shard, h, act),
        # input, top-k ids (int64) and probabilities (fp32), routing map (bool); at capacity the
        # kept tokens' ids per expert (int64)
        "router": shard * h * act
        + shard * k * 12
        + shard * e
        + (routed // local // sources * e * 8 if capacity else 0),
        "permute": 2 * shard * k * 8,  # permutation indices (int64), the combine's and the dispatch's
        # the experts' input, the routing probabilities applied inside them (fp32), fc1 out, activation, fc2 in
        "experts": routed * h * act + routed * 4 + routed * ffn * (5 if model.swiglu else 3) * act,
    }
    shared = model.moe_shared_expert_intermediate_size
    if shared:
        out["shared_experts"] = shard * h * act + s * b * shared // tp * (5 if model.swiglu else 3) * act
    return out


def _embedding(model: ModelSpec, st: MemorySettings, dims: ParallelDims) -> int:
    """Token ids (int64; under TP the masked ids and the out-of-range mask), position ids, and the
    embedding dropout's mask (on the sequence shard under SP)."""
    tokens = model.seq_length // dims.cp * model.micro_batch_size
    out = tokens * 8 + (tokens if dims.tp > 1 else 0)
    if model.position_embedding_type == "learned_absolute":
        out += tokens * 8
    if st.hidden_dropout > 0:
        shard = tokens // (dims.tp if st.sequence_parallel and dims.tp > 1 else 1)
        out += int(shard * model.hidden_size * st.dropout_mask_bytes)
    return out


def _output(model: ModelSpec, st: MemorySettings, dims: ParallelDims, act: int) -> int:
    """Final norm, output layer input, vocab-parallel cross-entropy (softmax in fp32, target mask,
    target ids)."""
    tp, b, s = dims.tp, model.micro_batch_size, model.seq_length // dims.cp
    sp = st.sequence_parallel and tp > 1
    tokens, shard = s * b, s * b // (tp if sp else 1)
    softmax = tokens * model.padded_vocab(tp) // tp * (act if st.fp16_lm_cross_entropy else 4)
    return _norm(model, st, shard, model.hidden_size, act) + shard * model.hidden_size * act + softmax + tokens * 9


def _mtp_layer(model: ModelSpec, st: MemorySettings, dims: ParallelDims, act: int, layer: int) -> tuple[int, int, int]:
    """One MTP layer (megatron-core 0.16.1's MultiTokenPredictionLayer, then GPTModel's MTP loss): (bytes
    kept from forward, bytes its recomputed unit adds in backward under full recompute, bytes of the kept
    ones still alive then: the unit's inputs, after the output layer's backward). Its embedding
    of the rolled ids, the enorm / hnorm of the embedding and the decoder's output, eh_proj's input (their
    concatenation, [s, b, 2h]), ``layer`` (a layer of the decoder's last kind) and its final norm; then
    its share of the output layer's input (one concatenation of the decoder's and the MTP layers' hidden
    states), its own cross-entropy, and the loss mask and the scaled loss MTPLossAutoScaler keeps. Full
    uniform recompute checkpoints the projection, the layer and the final norm, keeping their two inputs;
    under full block recompute megatron-core 0.16.1 runs the MTP layer without it (a warning: "not
    supported for MTP yet"), so it keeps everything."""
    tp, b, s, h = dims.tp, model.micro_batch_size, model.seq_length // dims.cp, model.hidden_size
    sp = st.sequence_parallel and tp > 1
    tokens, shard = s * b, s * b // (tp if sp else 1)
    unit = 2 * _norm(model, st, shard, h, act) + 2 * shard * h * act + layer + _norm(model, st, shard, h, act)
    if sp and (model.normalization != "RMSNorm" or st.fused_rms_norm or act == 4):
        # eh_proj's output is gathered over TP and scattered back: the layer's norm saves the view's storage
        unit += (tokens - shard) * h * act
    rest = _embedding(model, st, dims) + _output(model, st, dims, act) - _norm(model, st, shard, h, act)
    rest += 2 * tokens * 4 + 4  # the rolled loss mask, the scaled per-token loss, the token count
    if st.recompute_granularity == "full" and st.recompute_method == "uniform":
        inputs = 2 * shard * h * act
        return rest + inputs, unit, inputs
    return rest + unit, 0, 0


def _recompute_plan(st: MemorySettings, layers: list[int], unit_input: int, scores: int) -> list[tuple[int, int]]:
    """(bytes kept from forward, bytes added while recomputed in backward) per recompute unit, bottom
    to top. Full uniform: units of --recompute-num-layers layers keep their input; full block: the
    first --recompute-num-layers layers each keep their input, the rest keep everything; selective:
    each layer drops its core attention's scores and recomputes them."""
    if st.recompute_granularity == "selective" and not st.fused_attention:
        return [(full, scores) for full in layers]
    if st.recompute_granularity != "full":
        return [(full, 0) for full in layers]
    n = st.recompute_num_layers or 1
    if st.recompute_method == "block":
        return [(unit_input, full - unit_input) if i < n else (full, 0) for i, full in enumerate(layers)]
    units = [layers[i : i + n] for i in range(0, len(layers), n)]
    return [(unit_input, sum(unit) - unit_input) for unit in units]


def _chunk_activations(
    model: ModelSpec,
    st: MemorySettings,
    dims: ParallelDims,
    first: bool,
    last: bool,
    moe: list[bool],
    act: int,
    final_norm: bool | None = None,
) -> tuple[int, int, dict[str, int]]:
    """(bytes one micro-batch of this chunk saves, the most alive for it during its backward, bytes by
    layer type). Backward runs top down: the output layer's and the upper layers' tensors are freed
    before a lower unit is recomputed. ``final_norm``: the chunk holds the decoder's final norm (None:
    the last chunk; with MTP the chunk of the last decoder layer)."""
    capacity = model.moe_expert_capacity_factor
    attn_parts = _attention(model, st, dims, act)
    attn = sum(attn_parts.values())
    dense, moe_layer = sum(_mlp(model, st, dims, act).values()), sum(_moe(model, st, dims, act, capacity).values())
    layers = [attn + (moe_layer if m else dense) for m in moe]
    embedding = _embedding(model, st, dims) if first else 0
    shard = model.seq_length // dims.cp * model.micro_batch_size // (dims.tp if st.sequence_parallel else 1)
    norm = _norm(model, st, shard, model.hidden_size, act)
    output = _output(model, st, dims, act) - norm if last else 0
    output += norm if (last if final_norm is None else final_norm) else 0
    mtp_added = mtp_inputs = 0
    if last and model.mtp_num_layers:
        last_layer = attn + (moe_layer if model.moe_layers(model.num_layers - 1, 1)[0] else dense)
        mtp = _mtp_layer(model, st, dims, act, last_layer)
        output += model.mtp_num_layers * mtp[0]
        # the top MTP layer's unit recomputed while the others' inputs are still kept
        mtp_added, mtp_inputs = mtp[1], model.mtp_num_layers * mtp[2]
    tp_sp = dims.tp if st.sequence_parallel and dims.tp > 1 else 1
    unit_input = model.seq_length // dims.cp * model.micro_batch_size // tp_sp * model.hidden_size * act
    scores = _attention(model, replace(st, recompute_granularity=None), dims, act)["core_attn"]
    plan = _recompute_plan(st, layers, unit_input, scores)
    kept = sum(k for k, _ in plan)
    # backward runs top down: the MTP layers' recomputed units while every layer below still holds its part
    during, below = max(embedding + output, embedding + kept + mtp_inputs + mtp_added), embedding
    for k, added in plan:
        below += k
        during = max(during, below + added)
    by_type = {"embedding": embedding, "output": output}
    if st.recompute_granularity == "full":
        by_type["layers (recompute: kept)"] = kept
    else:
        by_type |= {"attention": attn * len(moe), "mlp": dense * moe.count(False), "moe": moe_layer * moe.count(True)}
    return embedding + kept + output, during, by_type


def in_flight(pp: int, vpp: int, pp_rank: int, microbatches: int, group: int | None = None) -> tuple[dict, int]:
    """Micro-batches alive per chunk at the schedule's peak, megatron-core's 1F1B / interleaved order:
    ({chunk: count}, index of the forward that reaches it). Non-interleaved: min(PP - stage, M)."""
    group = group or pp
    total = microbatches * vpp
    if vpp == 1:
        warmup = min(pp - pp_rank - 1, microbatches)
    else:
        warmup = (pp - pp_rank - 1) * 2 + (vpp - 1) * group
    warmup = min(warmup, total)

    def fwd_chunk(k: int) -> int:
        return (k // group) % vpp

    def bwd_chunk(k: int) -> int:
        return vpp - 1 - (k // group) % vpp

    alive = dict.fromkeys(range(vpp), 0)
    best, best_at = dict(alive), -1
    for k in range(warmup):
        alive[fwd_chunk(k)] += 1
        if sum(alive.values()) > sum(best.values()):
            best, best_at = dict(alive), k
    for j, k in enumerate(range(warmup, total)):
        alive[fwd_chunk(k)] += 1
        if sum(alive.values()) > sum(best.values()):
            best, best_at = dict(alive), k
        alive[bwd_chunk(j)] -= 1
    return best, best_at


def _received_input(model: ModelSpec, st: MemorySettings, dims: ParallelDims) -> int:
    """A later pipeline stage holds one received activation ([s, b, h], the sequence shard under SP) beyond
    its micro-batches in flight: measured (--memory-report's peak, cpu target), the previous micro-batch's
    received input, a leaf megatron-core's 1F1B schedule no longer references after its backward, is still
    alive while the next forward saves, on every stage after the first (PP2, PP2 x VPP2, PP4, uneven stages,
    with and without SP, block recompute: exactly one). Not under full uniform recompute, where every layer
    is a checkpoint and none was measured; what keeps it alive is not pinned down."""
    if st.recompute_granularity == "full" and st.recompute_method == "uniform":
        return 0
    tp_sp = dims.tp if st.sequence_parallel and dims.tp > 1 else 1
    tokens = model.seq_length // dims.cp * model.micro_batch_size // tp_sp
    return tokens * model.hidden_size * DTYPE_BYTES[model.params_dtype]


def _peak(saved: dict[int, int], during: dict[int, int], counts: dict[int, int], loss: int) -> int:
    """Bytes alive at the peak: the in-flight micro-batches after the forward that reaches it, or
    while the oldest of them runs backward (a recomputed unit's working set), plus the loss
    function's saved [b, s] on the last stage."""
    stored = sum(saved[c] * n for c, n in counts.items())
    backward = max((stored - saved[c] + during[c] for c, n in counts.items() if n), default=0)
    return max(stored, backward) + loss


# ---- per rank ------------------------------------------------------------------------------------


def predict(model: ModelSpec, dims: ParallelDims, st: MemorySettings, rank: int) -> RankMemory:
    """One rank's bytes: state (params, grads, optimizer) and the activations at the schedule's peak."""
    coords = rank_coordinates(dims, rank)
    buffers, chunks, patterns = _rank_buffers(model, st, dims, coords)
    param_bytes, grad_bytes, opt_bytes = _state_bytes(model, st, buffers)
    act = DTYPE_BYTES[model.params_dtype]
    pp, vpp = dims.pp, dims.virtual_stages
    saved, during, by_type = {}, {}, {}
    layers = chunk_layers(dims, model.num_layers, coords["pp"])
    for c, moe in enumerate(patterns):
        vstage, last = c * pp + coords["pp"], c * pp + coords["pp"] == pp * vpp - 1
        norm = holds_final_norm(model, *layers[c], last)
        saved[c], during[c], types = _chunk_activations(model, st, dims, vstage == 0, last, moe, act, norm)
        for k, v in types.items():
            by_type[k] = by_type.get(k, 0) + v
    mbs = dims.microbatches(model.global_batch_size, model.micro_batch_size)
    counts, _ = in_flight(pp, vpp, coords["pp"], mbs, st.microbatch_group_size_per_vp_stage)
    # pretrain_gpt.py's loss_func: the mask times the per-token losses keeps one fp32 [b, s]
    loss = 4 * model.micro_batch_size * model.seq_length // dims.cp if coords["pp"] == pp - 1 else 0
    loss += _received_input(model, st, dims) if coords["pp"] > 0 else 0
    return RankMemory(
        rank=rank,
        pp_rank=coords["pp"],
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=opt_bytes,
        saved_per_microbatch=saved,
        saved_by_type={k: v for k, v in by_type.items() if v},
        in_flight=counts,
        saved_peak_bytes=_peak(saved, during, counts, loss),
    )


def rank_coordinates(dims: ParallelDims, rank: int) -> dict[str, int]:
    """megatron-core's rank order tp-cp-ep-dp-pp (RankGenerator): this rank's pp stage, its index in
    the dense gradient group (dp x cp) and in the experts' (expert dp)."""
    tp, cp, pp = dims.tp, dims.cp, dims.pp
    per_stage = dims.world_size // pp
    pp_rank, in_stage = rank // per_stage, rank % per_stage
    dp_cp = in_stage // tp  # cp and dp above tp: the dp x cp group index
    etp_ep = dims.expert_tp * dims.ep
    return {"pp": pp_rank, "dp_cp": dp_cp % (dims.dp * cp), "edp": in_stage // etp_ep}


# ---- from the trainer's settings ------------------------------------------------------------------


def _dtype(args: Any) -> str:
    if arg_value(args, "bf16", False):
        return "bf16"
    return "fp16" if arg_value(args, "fp16", False) else "fp32"


def model_spec_from_args(args: Any) -> ModelSpec:
    """The planner's ModelSpec from pretrain_gpt.py's settings (a validated Namespace or args.json)."""
    padded = arg_value(args, "padded_vocab_size")
    vocab = padded or arg_value(args, "vocab_size")
    if vocab is None:
        raise ValueError("the vocabulary size is unknown: give --vocab-size")
    if padded is None and arg_value(args, "tokenizer_type") == "NullTokenizer":
        vocab += 1  # NullTokenizer's ids plus its eod
    fp32_grads = arg_value(args, "accumulate_allreduce_grads_in_fp32")
    spec = ModelSpec.from_shape(
        ModelShape.from_args(args),
        seq_length=int(arg_value(args, "seq_length")),
        micro_batch_size=int(arg_value(args, "micro_batch_size", 1)),
        global_batch_size=int(arg_value(args, "global_batch_size")),
        untie_embeddings_and_output_weights=bool(arg_value(args, "untie_embeddings_and_output_weights", False)),
        add_bias_linear=bool(arg_value(args, "add_bias_linear", True)),
        normalization=arg_value(args, "normalization", "LayerNorm"),
        position_embedding_type=arg_value(args, "position_embedding_type", "learned_absolute"),
        max_position_embeddings=arg_value(args, "max_position_embeddings"),
        params_dtype=_dtype(args),
        grad_reduce_in_fp32=None if fp32_grads is None else bool(fp32_grads),
        num_experts=arg_value(args, "num_experts"),
        moe_router_topk=int(arg_value(args, "moe_router_topk", 2)),
        moe_layer_freq=arg_value(args, "moe_layer_freq", 1),
        moe_ffn_hidden_size=arg_value(args, "moe_ffn_hidden_size"),
        moe_shared_expert_intermediate_size=arg_value(args, "moe_shared_expert_intermediate_size"),
        moe_shared_expert_gate=bool(arg_value(args, "moe_shared_expert_gate", False)),
        moe_expert_capacity_factor=arg_value(args, "moe_expert_capacity_factor"),
        moe_pad_expert_input_to_capacity=bool(arg_value(args, "moe_pad_expert_input_to_capacity", False)),
        **_architecture_from_args(args),
    )
    spec.vocab_size = vocab
    return spec


def _architecture_from_args(args: Any) -> dict[str, Any]:
    """MLA, MTP, QK norms and sliding windows, as Megatron-LM's flags name them (its defaults where unset)."""
    window = arg_value(args, "window_size")
    return {
        "qk_layernorm": bool(arg_value(args, "qk_layernorm", False)),
        "multi_latent_attention": bool(arg_value(args, "multi_latent_attention", False)),
        "q_lora_rank": arg_value(args, "q_lora_rank"),
        "kv_lora_rank": int(arg_value(args, "kv_lora_rank", 512) or 512),
        "qk_head_dim": int(arg_value(args, "qk_head_dim", 128) or 128),
        "qk_pos_emb_head_dim": int(arg_value(args, "qk_pos_emb_head_dim", 64) or 64),
        "v_head_dim": int(arg_value(args, "v_head_dim", 128) or 128),
        "mtp_num_layers": arg_value(args, "mtp_num_layers"),
        "window_size": tuple(window) if window is not None else None,
        "window_attn_skip_freq": arg_value(args, "window_attn_skip_freq"),
        "softmax_type": arg_value(args, "softmax_type", "vanilla") or "vanilla",
    }


def settings_from_args(args: Any) -> MemorySettings:
    modules = arg_value(args, "recompute_modules") or ["core_attn"]
    return MemorySettings(
        use_distributed_optimizer=bool(arg_value(args, "use_distributed_optimizer", False)),
        sequence_parallel=bool(arg_value(args, "sequence_parallel", False)),
        overlap_grad_reduce=bool(arg_value(args, "overlap_grad_reduce", False)),
        bucket_size=arg_value(args, "ddp_bucket_size"),
        recompute_granularity=arg_value(args, "recompute_granularity"),
        recompute_method=arg_value(args, "recompute_method"),
        recompute_num_layers=arg_value(args, "recompute_num_layers"),
        recompute_modules=tuple(modules),
        fused_attention=bool(arg_value(args, "use_flash_attn", False)),
        attention_dropout=float(arg_value(args, "attention_dropout", 0.1)),
        hidden_dropout=float(arg_value(args, "hidden_dropout", 0.1)),
        fp16_lm_cross_entropy=bool(arg_value(args, "fp16_lm_cross_entropy", False)),
        optimizer=arg_value(args, "optimizer", "adam"),
        fsdp_strategy=fsdp_scheme(args),
        microbatch_group_size_per_vp_stage=arg_value(args, "microbatch_group_size_per_vp_stage"),
    )


def predict_from_args(
    args: Any, rank: int, world_size: int | None = None, dropout_mask_bytes: float | None = None
) -> RankMemory:
    """``predict`` for the rank of a run given by its settings (world size from the settings);
    ``dropout_mask_bytes``: what the device's dropout saves per element, where measured."""
    world = world_size or int(arg_value(args, "world_size"))
    dims = ParallelDims.from_args(args, world)
    settings = settings_from_args(args)
    if dropout_mask_bytes is not None:
        settings = replace(settings, dropout_mask_bytes=dropout_mask_bytes)
    return predict(model_spec_from_args(args), dims, settings, rank)


def predict_all(model: ModelSpec, dims: ParallelDims, st: MemorySettings) -> list[RankMemory]:
    """One RankMemory per distinct (pp stage, dp position) is enough for a search; this gives every rank."""
    return [predict(model, dims, st, r) for r in range(dims.world_size)]


# ---- predicted vs measured (--memory-report's files, for perf-report) ------------------------------


def read_reports(log_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """``LOG_DIR/memory/rank*.json`` (pretrain_gpt.py --memory-report), by rank; [] when absent."""
    folder = Path(log_dir) / "memory"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))] if folder.is_dir() else []


def format_reports(reports: list[dict[str, Any]]) -> str:
    """Predicted beside measured per rank (MB = 1e6 bytes): state exact, activations at the peak."""
    out = [
        "memory per rank, predicted (megatron_npu/layout/memory.py) / measured (--memory-report), MB:",
        f"  {'rank':>4} {'params':>15} {'grads':>15} {'optimizer':>15} {'act. peak':>15} {'act. err':>8}",
    ]
    for r in reports:
        p = r.get("predicted") or {}

        def pair(key: str, p: dict = p, r: dict = r) -> str:
            return f"{p.get(key, float('nan')) / 1e6:7.2f}/{r[key] / 1e6:<7.2f}"

        peak = r["saved_peak_bytes"]
        err = (p["saved_peak_bytes"] - peak) / peak if p and peak else float("nan")
        out.append(
            f"  {r['rank']:4d} {pair('param_bytes')} {pair('grad_bytes')} {pair('optimizer_bytes')} "
            f"{pair('saved_peak_bytes')} {err:+8.1%}"
        )
    return "\n".join(out)
