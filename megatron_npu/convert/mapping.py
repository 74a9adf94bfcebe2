"""Which megatron-core tensor is made of which Hugging Face tensors, both ways.

Names are those of one whole GPTModel (TP1, PP1) built with pretrain_gpt.py's local spec:
dist-checkpointing stores global tensors, so the same checkpoint loads under any TP x PP
(x VPP) layout. Every transform is a reshape, a concatenation or a transpose, so a round
trip gives the same bits. Layouts (megatron-core's, not documented in one place):

- ``linear_qkv``: rows grouped per query group, ``[q heads of group g; k_g; v_g]`` for each g,
  so that a TP shard of rows is whole groups (HF keeps q, k and v apart).
- ``linear_fc1`` with SwiGLU: ``[gate; up]`` (megatron-core's factory splits each half per TP rank).
- GPT-2's ``Conv1D`` stores ``[in, out]``: transposed against ``nn.Linear``.
- Experts: ``mlp.experts.local_experts.{e}`` (SequentialMLP's names, which the trainer's
  ``--moe-grouped-gemm`` keeps), saved as one tensor per layer with an expert axis (global expert
  index, so any EP size loads it); the router's ``[experts, hidden]`` weight as HF's gate.
- gpt-oss holds each layer's experts as one HF tensor (``gate_up_proj`` ``[experts, in, 2 x ffn]`` with
  gate and up columns interleaved, ``down_proj`` ``[experts, ffn, in]``, their biases): each expert's
  rule names its row (``expert_slice``), which the reader reads alone and the export stacks back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from megatron_npu.convert.hf_config import ModelSpec

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    to_megatron: Callable[[Tensors], torch.Tensor]
    to_hf: Callable[[torch.Tensor], Tensors]


def _same(ts: Tensors) -> torch.Tensor:
    return ts[0]


def _one(t: torch.Tensor) -> Tensors:
    return [t]


def _t(ts: Tensors) -> torch.Tensor:
    return ts[0].t().contiguous()


def _t_back(t: torch.Tensor) -> Tensors:
    return [t.t().contiguous()]


def _qkv(spec: ModelSpec) -> tuple[Callable[[Tensors], torch.Tensor], Callable[[torch.Tensor], Tensors]]:
    groups, d = spec.num_query_groups, spec.kv_channels
    per_group = spec.num_heads // groups

    def to_megatron(ts: Tensors) -> torch.Tensor:
        q, k, v = ts
        rest = q.shape[1:]
        fused = torch.cat(
            [q.reshape(groups, per_group * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
        )
        return fused.reshape(-1, *rest)

    def to_hf(t: torch.Tensor) -> Tensors:
        rest = t.shape[1:]
        q, k, v = t.reshape(groups, (per_group + 2) * d, *rest).split([per_group * d, d, d], dim=1)
        return [q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous()]

    return to_megatron, to_hf


def _gpt2_qkv(
    spec: ModelSpec, weight: bool
) -> tuple[Callable[[Tensors], torch.Tensor], Callable[[torch.Tensor], Tensors]]:
    """GPT-2's c_attn is one ``[in, q|k|v]`` tensor (Conv1D): transpose, split, then group."""
    to_megatron, to_hf = _qkv(spec)

    def in_(ts: Tensors) -> torch.Tensor:
        fused = ts[0].t() if weight else ts[0]
        return to_megatron(list(fused.chunk(3, dim=0)))

    def out(t: torch.Tensor) -> Tensors:
        fused = torch.cat(to_hf(t), dim=0)
        return [fused.t().contiguous() if weight else fused]

    return in_, out


def _vocab(
    spec: ModelSpec, hf_name: str, cut: dict[str, torch.Tensor]
) -> tuple[Callable[[Tensors], torch.Tensor], Callable[[torch.Tensor], Tensors]]:
    """Megatron's rows: the tokenizer's count padded for TP. Rows past the HF ones are zero;
    HF rows past Megatron's (unused by the tokenizer) are cut, and come back from ``cut``."""

    def fit(t: torch.Tensor, rows: int) -> torch.Tensor:
        if t.shape[0] >= rows:
            return t[:rows].contiguous()
        tail = cut.get(hf_name)
        if tail is None or t.shape[0] + tail.shape[0] != rows:
            tail = t.new_zeros(rows - t.shape[0], *t.shape[1:])
        return torch.cat([t, tail.to(t.dtype)])

    return (lambda ts: fit(ts[0], spec.padded_vocab_size)), (lambda t: [fit(t, spec.vocab_size)])


VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def rules(spec: ModelSpec, cut: dict[str, torch.Tensor] | None = None) -> Iterator[Rule]:
    """Every megatron-core tensor of the model and its HF source; ``cut``: the HF vocabulary
    rows the import cut (by HF name), which the export puts back."""
    yield from (_gpt2_rules if spec.gpt2 else _llama_rules)(spec, cut or {})


def _swiglu(gate_up: tuple[str, str]) -> tuple[tuple[str, str], Callable, Callable]:
    return gate_up, lambda ts: torch.cat(ts), lambda t: [c.contiguous() for c in t.chunk(2)]


# HF's names of one expert's gate, up and down projections, and of the router, per family
EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe.experts.{e}.", ("w1", "w3", "w2"), "block_sparse_moe.gate.weight"),
    "qwen3_moe": ("mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj"), "mlp.gate.weight"),
    "deepseek_v3": ("mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj"), "mlp.gate.weight"),
}


def expert_slice(name: str, e: int) -> str:
    """The HF name of expert ``e``'s slice of a tensor holding all experts on a leading axis: ``name[e]``
    (the reader reads that row alone; the export stacks the rows back)."""
    return f"{name}[{e}]"


def sliced(name: str) -> tuple[str, int | None]:
    """(tensor name, expert row) of an ``expert_slice`` name; (name, None) for a whole tensor."""
    if not name.endswith("]"):
        return name, None
    base, row = name[:-1].rsplit("[", 1)
    return base, int(row)


def _interleaved_glu(ts: Tensors) -> torch.Tensor:
    """gpt-oss's gate_up ``[in, 2I]`` (or bias ``[2I]``) interleaves gate and up columns; megatron-core's
    fc1 is ``[gate; up]`` rows."""
    t = ts[0].t() if ts[0].dim() == 2 else ts[0]
    return torch.cat([t[0::2], t[1::2]]).contiguous()


def _interleaved_glu_back(t: torch.Tensor) -> Tensors:
    gate, up = t.chunk(2)
    glu = torch.stack([gate, up], dim=1).reshape(-1, *t.shape[1:])
    return [glu.t().contiguous() if glu.dim() == 2 else glu]


def _gpt_oss_mlp_rules(spec: ModelSpec, m: str, h: str) -> Iterator[Rule]:
    """gpt-oss: router with bias; the experts stacked per layer in HF ([experts, in, out], gate and up
    interleaved), one SequentialMLP expert each in megatron-core."""
    for kind in ("weight", "bias"):
        yield Rule(f"{m}mlp.router.{kind}", (f"{h}mlp.router.{kind}",), _same, _one)
    x = h + "mlp.experts."
    for e in range(spec.moe.num_experts):
        me = f"{m}mlp.experts.local_experts.{e}."
        parts = (
            ("linear_fc1.weight", "gate_up_proj", _interleaved_glu, _interleaved_glu_back),
            ("linear_fc1.bias", "gate_up_proj_bias", _interleaved_glu, _interleaved_glu_back),
            ("linear_fc2.weight", "down_proj", _t, _t_back),
            ("linear_fc2.bias", "down_proj_bias", _same, _one),
        )
        for megatron, hf, to_megatron, to_hf in parts:
            yield Rule(me + megatron, (expert_slice(x + hf, e),), to_megatron, to_hf)


def _mlp_rules(spec: ModelSpec, i: int, m: str, h: str) -> Iterator[Rule]:
    """Layer i's MLP: dense (gate/up/down) or routed experts with their router."""
    if spec.gpt_oss is not None:
        yield from _gpt_oss_mlp_rules(spec, m, h)
        return
    if spec.moe is None or not spec.moe.layers[i]:
        yield Rule(m + "mlp.linear_fc1.weight", *_swiglu((h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight")))
        yield Rule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), _same, _one)
        return
    expert, (gate, up, down), router = EXPERT_NAMES[spec.family]
    yield Rule(m + "mlp.router.weight", (h + router,), _same, _one)
    if spec.moe.expert_bias:  # DeepSeek-V3's score correction: megatron-core's expert bias (a buffer)
        yield Rule(m + "mlp.router.expert_bias", (h + "mlp.gate.e_score_correction_bias",), _same, _one)
    if spec.moe.shared_ffn_hidden_size:
        shared = h + "mlp.shared_experts."
        gate_up = (shared + "gate_proj.weight", shared + "up_proj.weight")
        yield Rule(m + "mlp.shared_experts.linear_fc1.weight", *_swiglu(gate_up))
        yield Rule(m + "mlp.shared_experts.linear_fc2.weight", (shared + "down_proj.weight",), _same, _one)
    for e in range(spec.moe.num_experts):
        me, he = f"{m}mlp.experts.local_experts.{e}.", h + expert.format(e=e)
        yield Rule(me + "linear_fc1.weight", *_swiglu((f"{he}{gate}.weight", f"{he}{up}.weight")))
        yield Rule(me + "linear_fc2.weight", (f"{he}{down}.weight",), _same, _one)


def _mla_rules(spec: ModelSpec, m: str, h: str) -> Iterator[Rule]:
    """Multi-latent attention: the same matrices both sides (megatron-core splits the kv down
    projection's output [kv latent; rotated k] and the up projections' per-head [nope; rope] /
    [k nope; v] as transformers does)."""
    pairs = [
        ("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
        ("kv_layernorm.weight", "kv_a_layernorm.weight"),
    ]
    pairs += [("linear_kv_up_proj.weight", "kv_b_proj.weight")]
    if spec.mla.q_lora_rank is None:
        pairs += [("linear_q_proj.weight", "q_proj.weight")]
    else:
        pairs += [("linear_q_down_proj.weight", "q_a_proj.weight"), ("q_layernorm.weight", "q_a_layernorm.weight")]
        pairs += [("linear_q_up_proj.weight", "q_b_proj.weight")]
    for megatron, hf in pairs:
        yield Rule(m + megatron, (h + hf,), _same, _one)


def _copies(hf: tuple[str, ...], rule: tuple[Callable, Callable]) -> tuple[tuple[str, ...], Callable, Callable]:
    """One megatron-core tensor saved under several HF names (DeepSeek-V3's MTP layer repeats the
    embedding and the output layer): read from the first, written to each."""
    to_megatron, to_hf = rule
    return hf, lambda ts: to_megatron(ts[:1]), lambda t: to_hf(t) * len(hf)


def _layer_rules(spec: ModelSpec, i: int, m: str, h: str) -> Iterator[Rule]:
    """One decoder layer (``i``: whose MLP kind it has) from megatron-core prefix ``m``, HF prefix ``h``."""
    yield Rule(m + "input_layernorm.weight", (h + "input_layernorm.weight",), _same, _one)
    if spec.mla is not None:
        yield from _mla_rules(spec, m + "self_attention.", h + "self_attn.")
    else:
        qkv_in, qkv_out = _qkv(spec)
        for kind in ("weight", "bias") if spec.qkv_bias or spec.gpt_oss else ("weight",):
            names = tuple(f"{h}self_attn.{p}_proj.{kind}" for p in "qkv")
            yield Rule(f"{m}self_attention.linear_qkv.{kind}", names, qkv_in, qkv_out)
    if spec.qk_layernorm and spec.mla is None:  # per-head norms of q and k: [kv_channels] both sides
        for p in "qk":
            yield Rule(f"{m}self_attention.{p}_layernorm.weight", (f"{h}self_attn.{p}_norm.weight",), _same, _one)
    yield Rule(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), _same, _one)
    if spec.gpt_oss:  # o_proj's bias; the sinks: megatron-core's learnable softmax offset, one per head
        yield Rule(m + "self_attention.linear_proj.bias", (h + "self_attn.o_proj.bias",), _same, _one)
        yield Rule(m + "self_attention.core_attention.softmax_offset", (h + "self_attn.sinks",), _same, _one)
    yield Rule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), _same, _one)
    yield from _mlp_rules(spec, i, m, h)


def _llama_rules(spec: ModelSpec, cut: dict[str, torch.Tensor]) -> Iterator[Rule]:
    # DeepSeek-V3's MTP layers follow the decoder's in HF (model.layers.{num_layers + j}), each with
    # copies of the embedding and the output layer, which megatron-core's MTP block shares
    mtp = [f"model.layers.{spec.num_layers + j}." for j in range(spec.mtp_layers)]
    embedding = ("model.embed_tokens.weight", *(h + "embed_tokens.weight" for h in mtp))
    yield Rule(VOCAB_TENSORS[0], *_copies(embedding, _vocab(spec, embedding[0], cut)))
    for i in range(spec.num_layers):
        yield from _layer_rules(spec, i, f"decoder.layers.{i}.", f"model.layers.{i}.")
    yield Rule("decoder.final_layernorm.weight", ("model.norm.weight",), _same, _one)
    for j, h in enumerate(mtp):
        m = f"mtp.layers.{j}."
        for megatron, hf in (("enorm", "enorm"), ("hnorm", "hnorm"), ("final_layernorm", "shared_head.norm")):
            yield Rule(f"{m}{megatron}.weight", (f"{h}{hf}.weight",), _same, _one)
        yield Rule(m + "eh_proj.weight", (h + "eh_proj.weight",), _same, _one)  # [embedding; hidden] both sides
        yield from _layer_rules(spec, spec.num_layers - 1, m + "transformer_layer.", h)  # the last layer's kind
    if not spec.tied_embeddings:
        output = ("lm_head.weight", *(h + "shared_head.head.weight" for h in mtp))
        yield Rule(VOCAB_TENSORS[1], *_copies(output, _vocab(spec, output[0], cut)))


def _gpt2_rules(spec: ModelSpec, cut: dict[str, torch.Tensor]) -> Iterator[Rule]:
    yield Rule(VOCAB_TENSORS[0], ("transformer.wte.weight",), *_vocab(spec, "transformer.wte.weight", cut))
    yield Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",), _same, _one)
    for i in range(spec.num_layers):
        m, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            linear_in, linear_out = (_t, _t_back) if kind == "weight" else (_same, _one)
            yield Rule(f"{m}input_layernorm.{kind}", (f"{h}ln_1.{kind}",), _same, _one)
            yield Rule(
                f"{m}self_attention.linear_qkv.{kind}", (f"{h}attn.c_attn.{kind}",), *_gpt2_qkv(spec, kind == "weight")
            )
            yield Rule(f"{m}self_attention.linear_proj.{kind}", (f"{h}attn.c_proj.{kind}",), linear_in, linear_out)
            yield Rule(f"{m}pre_mlp_layernorm.{kind}", (f"{h}ln_2.{kind}",), _same, _one)
            yield Rule(f"{m}mlp.linear_fc1.{kind}", (f"{h}mlp.c_fc.{kind}",), linear_in, linear_out)
            yield Rule(f"{m}mlp.linear_fc2.{kind}", (f"{h}mlp.c_proj.{kind}",), linear_in, linear_out)
    for kind in ("weight", "bias"):
        yield Rule(f"decoder.final_layernorm.{kind}", (f"transformer.ln_f.{kind}",), _same, _one)
