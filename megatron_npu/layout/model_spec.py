"""The model description the planner, the memory model and the search share: ``ModelSpec`` (a GPT's
shape, named as Megatron-LM's flags), the bytes per dtype, and a model chunk's parameters in
megatron-core's ``named_parameters()`` order (local spec).

A library module: it imports nothing above ``megatron_npu.layout`` (tests/test_import_graph.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_npu.layout.model_shape import ModelShape, pad_vocab_size
from megatron_npu.layout.moe import moe_layer_pattern

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


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
    position_embedding_type: str = "learned_absolute"  # or rope, yarn, none
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
    moe_expert_capacity_factor: float | None = None  # None: dropless
    qk_layernorm: bool = False
    multi_latent_attention: bool = False  # MLA (DeepSeek-V2/V3): the low-rank q / kv projections below
    q_lora_rank: int | None = None  # None: one q projection
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    mtp_num_layers: int | None = None  # multi-token prediction layers, on the last pipeline stage
    window_size: tuple[int, int] | None = None  # sliding-window attention (left, right); None: full causal
    window_attn_skip_freq: int | list[int] | None = None  # every N-th layer full attention (gpt-oss's pattern)
    softmax_type: str = "vanilla"  # or off-by-one / learnable (gpt-oss's sinks: one learnable logit per head)

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
    def core_attention_heads(self) -> tuple[int, int, int]:
        """(key / value heads, query / key head size, value head size) of what core attention receives:
        under multi-latent attention q and k carry ``qk_head_dim + qk_pos_emb_head_dim``, v ``v_head_dim``,
        and every attention head has its own k and v (megatron-core's MLASelfAttention; no query groups)."""
        if self.multi_latent_attention:
            return self.num_attention_heads, self.qk_head_dim + self.qk_pos_emb_head_dim, self.v_head_dim
        shape = self.shape
        return shape.num_query_groups, shape.kv_channels, shape.kv_channels

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


def stage_params(
    m: ModelSpec,
    tp: int,
    layers: int,
    first: bool,
    last: bool,
    pp: int,
    moe: list[bool] | None = None,
    experts: tuple[int, int] = (0, 1),
    final_norm: bool | None = None,
) -> list[tuple[str, int]]:
    """(name, numel) of one model chunk's parameters in named_parameters() order (local spec). An MoE
    layer (``moe``, per layer) has a router, ``experts`` = (local experts, expert TP) and the shared
    experts; under EP > 1 DDP reduces the experts (``is_expert``) over expert data parallel. The last
    chunk holds the MTP layers (each the decoder's last layer's kind) and, without the first, an
    embedding of its own for them. ``final_norm``: whether the chunk holds the decoder's final norm
    (None: the last chunk; with MTP the chunk of the last decoder layer, ``holds_final_norm``)."""
    h = m.hidden_size
    norm = _norm_names(m)
    vocab = m.padded_vocab(tp) // tp  # vocab-parallel rows on this rank
    mtp = (m.mtp_num_layers or 0) if last else 0
    out: list[tuple[str, int]] = []
    if first or mtp:
        out.append(("embedding.word_embeddings.weight", vocab * h))
        if m.position_embedding_type == "learned_absolute":
            out.append(("embedding.position_embeddings.weight", (m.max_position_embeddings or m.seq_length) * h))
    for i in range(layers):
        out += layer_params(m, tp, f"decoder.layers.{i}.", bool(moe and moe[i]), experts)
    if last if final_norm is None else final_norm:
        out += [("decoder.final_layernorm." + n, h) for n in norm]
    if last:
        last_is_moe = m.moe_layers(m.num_layers - 1, 1)[0]
        for j in range(mtp):
            p = f"mtp.layers.{j}."
            out += [(p + "enorm." + n, h) for n in norm] + [(p + "hnorm." + n, h) for n in norm]
            out.append((p + "eh_proj.weight", h // tp * 2 * h))  # column parallel, no bias
            out += layer_params(m, tp, p + "transformer_layer.", last_is_moe, experts)
            out += [(p + "final_layernorm." + n, h) for n in norm]
        if not m.tied or not first:  # tied on one stage: the output layer reuses the embedding
            out.append(("output_layer.weight", vocab * h))
    return out


def holds_final_norm(m: ModelSpec, start: int, count: int, last: bool) -> bool:
    """Whether the model chunk of layers ``start`` .. ``start + count - 1`` holds the decoder's final norm:
    the last chunk; with MTP the chunk of the last decoder layer (megatron-core 0.16.1's
    TransformerBlock.has_final_layernorm_in_this_stage), another one under a pipeline layout."""
    if not m.mtp_num_layers:
        return last
    return count > 0 and start + count == m.num_layers


def _norm_names(m: ModelSpec) -> list[str]:
    return ["weight"] if m.normalization == "RMSNorm" else ["weight", "bias"]


def layer_params(
    m: ModelSpec, tp: int, p: str, is_moe: bool, experts: tuple[int, int] = (0, 1)
) -> list[tuple[str, int]]:
    """One transformer layer's parameters (prefix ``p``): norms, attention, the MLP or the MoE layer."""
    shape, h, norm, bias = m.shape, m.hidden_size, _norm_names(m), m.add_bias_linear
    out = [(p + "input_layernorm." + n, h) for n in norm]
    out += _attention_params(m, tp, p + "self_attention.")
    out += [(p + "pre_mlp_layernorm." + n, h) for n in norm]
    if is_moe:
        return out + moe_params(m, tp, p + "mlp.", *experts)
    fc1_out = shape.fc1_out // tp
    out.append((p + "mlp.linear_fc1.weight", fc1_out * h))
    out += [(p + "mlp.linear_fc1.bias", fc1_out)] if bias else []
    out.append((p + "mlp.linear_fc2.weight", h * shape.ffn_hidden_size // tp))
    out += [(p + "mlp.linear_fc2.bias", h)] if bias else []
    return out


def _attention_params(m: ModelSpec, tp: int, p: str) -> list[tuple[str, int]]:
    """Self-attention: core attention's learnable sinks and the output projection first (megatron-core's
    Attention builds both before the subclass's input projections), then QKV (or MLA's low-rank
    projections), then the QK norms."""
    shape, h, norm, bias = m.shape, m.hidden_size, _norm_names(m), m.add_bias_linear
    heads = m.num_attention_heads
    sinks = [(p + "core_attention.softmax_offset", heads // tp)] if m.softmax_type == "learnable" else []
    if m.multi_latent_attention:
        q_dim, v_dim = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
        out = sinks + [(p + "linear_proj.weight", h * heads * v_dim // tp)]
        out += [(p + "linear_proj.bias", h)] if bias else []
        if m.q_lora_rank is None:
            out.append((p + "linear_q_proj.weight", heads * q_dim // tp * h))
        else:  # the local spec's down projections are column parallel too
            out.append((p + "linear_q_down_proj.weight", m.q_lora_rank // tp * h))
            out.append((p + "linear_q_up_proj.weight", heads * q_dim // tp * m.q_lora_rank))
        out.append((p + "linear_kv_down_proj.weight", (m.kv_lora_rank + m.qk_pos_emb_head_dim) // tp * h))
        out.append((p + "linear_kv_up_proj.weight", heads * (m.qk_head_dim + v_dim) // tp * m.kv_lora_rank))
        if m.qk_layernorm:
            out += [(p + "q_layernorm." + n, m.q_lora_rank) for n in norm] if m.q_lora_rank is not None else []
            out += [(p + "kv_layernorm." + n, m.kv_lora_rank) for n in norm]
        return out
    kv, groups = shape.kv_channels, shape.num_query_groups
    qkv_out = (heads + 2 * groups) * kv // tp
    out = sinks + [(p + "linear_proj.weight", h * heads * kv // tp)]
    out += [(p + "linear_proj.bias", h)] if bias else []
    out.append((p + "linear_qkv.weight", qkv_out * h))
    out += [(p + "linear_qkv.bias", qkv_out)] if bias else []
    if m.qk_layernorm:
        out += [(p + "q_layernorm." + n, kv) for n in norm] + [(p + "k_layernorm." + n, kv) for n in norm]
    return out


def moe_params(m: ModelSpec, tp: int, prefix: str, local_experts: int, etp: int) -> list[tuple[str, int]]:
    """An MoE layer's parameters: the router (replicated), the local experts (SequentialMLP, no bias)
    and the shared experts."""
    h, ffn = m.hidden_size, m.moe_ffn
    out = [(prefix + "router.weight", (m.num_experts or 0) * h)]
    for e in range(local_experts):
        p = f"{prefix}experts.local_experts.{e}."
        out.append((p + "linear_fc1.weight", ffn * (2 if m.swiglu else 1) // etp * h))
        out.append((p + "linear_fc2.weight", h * ffn // etp))
    shared = m.moe_shared_expert_intermediate_size
    if shared:  # the gate registers first (megatron-core's SharedExpertMLP sets it before its MLP's linears)
        out += [(prefix + "shared_experts.gate_weight", h)] if m.moe_shared_expert_gate else []
        out.append((prefix + "shared_experts.linear_fc1.weight", shared * (2 if m.swiglu else 1) // tp * h))
        out.append((prefix + "shared_experts.linear_fc2.weight", h * shared // tp))
    return out


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name
