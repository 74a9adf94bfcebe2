"""A Hugging Face ``config.json`` as the pretrain_gpt.py flags of the same model (no torch).

The raw JSON is read (not ``transformers.AutoConfig``) so the flags, and every refusal, come
before torch or megatron-core is imported. Both spellings of RoPE settings are read:
``rope_theta`` / ``rope_scaling`` (transformers 4) and ``rope_parameters`` (transformers 5).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from megatron_npu.layout.model_shape import ModelShape, pad_vocab_size
from megatron_npu.layout.parallel_dims import LayoutError

FAMILIES = {
    "llama": "LLaMA-2/3",
    "qwen2": "Qwen2/2.5",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE",
    "mistral": "Mistral",
    "mixtral": "Mixtral",
    "gpt2": "GPT-2",
    "deepseek_v3": "DeepSeek-V3",
    "gpt_oss": "gpt-oss",
}
# families named in the issue this converter cannot train exactly yet, and why
NOT_YET: dict[str, str] = {}
# gpt-oss's expert activation: megatron-core's quick_gelu fixes the sigmoid's alpha at 1.702
GPT_OSS_ALPHA = 1.702
# families whose attention normalises q and k per head (--qk-layernorm)
QK_NORM = ("qwen3", "qwen3_moe")
# megatron-core 0.16's MLA YaRN settings Megatron-LM core_v0.16.1 has no flag for (MLATransformerConfig's defaults)
MLA_YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
# megatron-core 0.16's RotaryEmbedding applies llama3 scaling with these constants fixed.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# config.json's names of the sizes TP splits (ModelShape's fields), for the messages
HF_NAMES = {
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "ffn_hidden_size": "intermediate_size",
}
GPT2_NAMES = {"num_attention_heads": "n_head", "num_query_groups": "n_head", "ffn_hidden_size": "n_inner"}


class ConvertError(ValueError):
    """A model or request the converter cannot handle; the message names the fix."""


@dataclass(frozen=True)
class MoESpec:
    """The routed experts of a Mixture-of-Experts model (megatron-core's MoELayer)."""

    num_experts: int
    ffn_hidden_size: int  # each expert's (--moe-ffn-hidden-size)
    topk: int
    pre_softmax: bool  # softmax over all experts, top-k not renormalised (Qwen3-MoE's norm_topk_prob false)
    layers: tuple[bool, ...]  # per decoder layer: MoE (True) or dense MLP
    shared_ffn_hidden_size: int | None = None  # all shared experts together (DeepSeek)
    sigmoid: bool = False  # sigmoid scores, top-k renormalised (DeepSeek-V3); else softmax
    expert_bias: bool = False  # aux-loss-free balancing bias added to the scores for choosing only
    num_groups: int | None = None  # group-limited routing: top-k of the best group_topk groups
    group_topk: int | None = None
    scaling_factor: float | None = None  # routed_scaling_factor

    def flags(self) -> list[str]:
        f = ["--num-experts", str(self.num_experts), "--moe-ffn-hidden-size", str(self.ffn_hidden_size)]
        f += ["--moe-router-topk", str(self.topk), "--moe-grouped-gemm"]
        if self.pre_softmax:
            f += ["--moe-router-pre-softmax"]
        if not all(self.layers):
            f += ["--moe-layer-freq", "[" + ",".join(str(int(x)) for x in self.layers) + "]"]
        if self.shared_ffn_hidden_size:
            f += ["--moe-shared-expert-intermediate-size", str(self.shared_ffn_hidden_size)]
        if self.sigmoid:  # HF routes in fp32 whatever the weights' dtype
            f += ["--moe-router-score-function", "sigmoid", "--moe-router-dtype", "fp32"]
        if self.expert_bias:
            f += ["--moe-router-enable-expert-bias"]
        if self.num_groups:
            f += ["--moe-router-num-groups", str(self.num_groups), "--moe-router-group-topk", str(self.group_topk)]
        if self.scaling_factor is not None:
            f += ["--moe-router-topk-scaling-factor", repr(self.scaling_factor)]
        return f


@dataclass(frozen=True)
class MLASpec:
    """Multi-latent attention (DeepSeek-V2/V3): q and kv through low-rank projections."""

    q_lora_rank: int | None  # None: one q projection
    kv_lora_rank: int
    qk_head_dim: int  # the part of q/k without positions (HF qk_nope_head_dim)
    qk_pos_emb_head_dim: int  # the rotated part (HF qk_rope_head_dim)
    v_head_dim: int
    yarn: tuple[float, float, float] | None  # (factor, mscale, mscale_all_dim)

    def flags(self) -> list[str]:
        # --qk-layernorm: megatron-core's MLA builds the q and kv latent norms only with it
        f = ["--multi-latent-attention", "--qk-layernorm", "--kv-lora-rank", str(self.kv_lora_rank)]
        if self.q_lora_rank is not None:
            f += ["--q-lora-rank", str(self.q_lora_rank)]
        f += ["--qk-head-dim", str(self.qk_head_dim), "--qk-pos-emb-head-dim", str(self.qk_pos_emb_head_dim)]
        f += ["--v-head-dim", str(self.v_head_dim)]
        if self.yarn is None:  # MLA's default is YaRN
            return f + ["--rope-type", "rope"]
        factor, mscale, mscale_all_dim = self.yarn
        f += ["--rope-type", "yarn", "--rotary-scaling-factor", repr(factor)]
        return f + ["--mscale", repr(mscale), "--mscale-all-dim", repr(mscale_all_dim)]


@dataclass(frozen=True)
class YarnSpec:
    """YaRN on standard attention: megatron-core's YarnRotaryEmbedding (--position-embedding-type yarn), whose
    frequencies and attention factor (on cos and sin, so on q and k) are transformers' _compute_yarn_parameters'."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float  # megatron-core's attention factor: yarn_get_mscale(factor, mscale) / (..., mscale_all_dim)
    mscale_all_dim: float
    round_to_int: bool  # HF truncate: the correction range's ends floored / ceiled

    def flags(self) -> list[str]:
        # Megatron-LM core_v0.16.1's YaRN flags (MLA's, applied to standard attention as core_v0.19.0 does) and
        # core_v0.19.0's --yarn-* flags for what core_v0.16.1 has none for
        f = ["--rotary-scaling-factor", repr(self.factor)]
        f += ["--yarn-original-max-position-embeddings", str(self.original_max_position_embeddings)]
        f += ["--yarn-beta-fast", repr(self.beta_fast), "--yarn-beta-slow", repr(self.beta_slow)]
        if (self.mscale, self.mscale_all_dim) != (1.0, 0.0):
            f += ["--mscale", repr(self.mscale), "--mscale-all-dim", repr(self.mscale_all_dim)]
        if not self.round_to_int:
            f += ["--no-yarn-correction-range-round-to-int"]
        return f


@dataclass(frozen=True)
class GptOssSpec:
    """gpt-oss's attention and activation: biases in every linear layer (router included), a learnable
    sink logit per head, a sliding window on the layers layer_types names, clamped quick-GeGLU."""

    window: int | None  # HF sliding_window: a query sees itself and the window - 1 tokens before it
    windowed: tuple[bool, ...]  # per layer: sliding_attention
    clamp: float  # swiglu_limit

    def flags(self) -> list[str]:
        f = ["--softmax-type", "learnable", "--quick-geglu", "--glu-linear-offset", "1.0"]
        f += ["--activation-func-clamp-value", repr(self.clamp)]
        if self.window is not None and any(self.windowed):
            # megatron-core's window (w, 0) lets a query see w tokens before it
            f += ["--window-size", f"{self.window - 1},0", "--window-attn-skip-freq", _layer_pattern(self.windowed)]
        return f


def _layer_pattern(windowed: tuple[bool, ...]) -> str:
    """--window-attn-skip-freq: N when every N-th layer (1-based) is full and the others windowed, else a list."""
    for n in range(2, len(windowed) + 1):
        if windowed == tuple((i + 1) % n != 0 for i in range(len(windowed))):
            return str(n)
    return "[" + ",".join(str(int(w)) for w in windowed) + "]"


@dataclass(frozen=True)
class ModelSpec:
    """The architecture both sides agree on, and the vocabulary padding for one TP size."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int  # rows of the HF embedding
    padded_vocab_size: int  # rows of the megatron embedding
    make_vocab_size_divisible_by: int
    max_position_embeddings: int
    norm_epsilon: float
    tied_embeddings: bool
    rotary_base: int | None = None  # None: learned absolute positions (GPT-2)
    rope_scaling_factor: float | None = None  # llama3-style scaling
    rope_linear_factor: int | None = None  # linear scaling (--rotary-seq-len-interpolation-factor)
    qkv_bias: bool = False
    qk_layernorm: bool = False
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    mtp_layers: int = 0  # DeepSeek-V3's multi-token prediction layers the checkpoint holds
    dtype: str = "float32"
    gpt_oss: GptOssSpec | None = None
    yarn: YarnSpec | None = None  # YaRN on standard attention

    @property
    def gpt2(self) -> bool:
        return self.family == "gpt2"

    def flags(self) -> list[str]:
        """pretrain_gpt.py's model flags for this architecture (Megatron-LM spelling)."""
        f = [
            "--num-layers",
            str(self.num_layers),
            "--hidden-size",
            str(self.hidden_size),
            "--num-attention-heads",
            str(self.num_heads),
            "--ffn-hidden-size",
            str(self.ffn_hidden_size),
            "--max-position-embeddings",
            str(self.max_position_embeddings),
            "--norm-epsilon",
            repr(self.norm_epsilon),
            "--make-vocab-size-divisible-by",
            str(self.make_vocab_size_divisible_by),
        ]
        if self.mla is not None:
            f += self.mla.flags()
        elif self.kv_channels * self.num_heads != self.hidden_size:
            f += ["--kv-channels", str(self.kv_channels)]
        if self.num_query_groups != self.num_heads:
            f += ["--group-query-attention", "--num-query-groups", str(self.num_query_groups)]
        if self.gpt2:
            f += ["--position-embedding-type", "learned_absolute", "--openai-gelu"]
        else:
            f += [
                "--position-embedding-type",
                "rope" if self.yarn is None else "yarn",
                "--rotary-base",
                str(self.rotary_base),
                "--normalization",
                "RMSNorm",
            ]
            f += self.gpt_oss.flags() if self.gpt_oss else ["--swiglu", "--disable-bias-linear"]
            if self.qkv_bias:
                f += ["--add-qkv-bias"]
            if self.qk_layernorm and self.mla is None:
                f += ["--qk-layernorm"]
            if self.rope_scaling_factor is not None:
                f += ["--use-rope-scaling", "--rope-scaling-factor", repr(self.rope_scaling_factor)]
            if self.rope_linear_factor is not None:
                f += ["--rotary-seq-len-interpolation-factor", str(self.rope_linear_factor)]
            if self.yarn is not None:
                f += self.yarn.flags()
        if not self.tied_embeddings:
            f += ["--untie-embeddings-and-output-weights"]
        if self.moe is not None:
            f += self.moe.flags()
        if self.mtp_layers:
            f += ["--mtp-num-layers", str(self.mtp_layers)]
        if self.dtype == "bfloat16":
            f += ["--bf16"]
        elif self.dtype == "float16":
            f += ["--fp16"]
        return f


def read_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(
            f"{model_dir}: no config.json (give a Hugging Face model directory, as save_pretrained writes)"
        )
    with open(path) as f:
        return json.load(f)


def _rope(cfg: dict) -> tuple[int, float | None, int | None, YarnSpec | None]:
    """(rotary base, llama3 factor, linear factor, YaRN) of standard attention."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "yarn":
        return int(theta), None, None, _yarn(cfg, scaling)
    return (int(theta), *_scaled_rope(kind, scaling), None)


def _scaled_rope(kind: str, scaling: dict) -> tuple[float | None, int | None]:
    """(llama3 factor, linear factor) of the RoPE scaling GPTModel's RotaryEmbedding applies."""
    if kind == "default":
        return None, None
    if kind == "linear":  # HF divides the frequencies, megatron-core the positions: the same angles
        factor = float(scaling["factor"])
        if not factor.is_integer():
            raise ConvertError(
                f"linear RoPE scaling by {factor}: pretrain_gpt.py's --rotary-seq-len-interpolation-factor "
                "takes an integer"
            )
        return None, int(factor)
    if kind == "llama3":
        differ = {k: scaling.get(k) for k, v in LLAMA3_FIXED.items() if float(scaling.get(k, v)) != v}
        if differ:
            raise ConvertError(
                f"llama3 RoPE scaling with {differ}: megatron-core 0.16 fixes {LLAMA3_FIXED}; this model cannot "
                "be trained with the same positions"
            )
        return float(scaling["factor"]), None
    if kind == "dynamic":  # dynamic NTK changes nothing up to the trained length (check_attention_window)
        return None, None
    raise ConvertError(
        f"RoPE scaling type {kind!r} is not supported by megatron-core's GPTModel (default, linear, llama3, yarn "
        "and dynamic up to its original length are)"
    )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for one mscale (transformers' and megatron-core's yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(cfg: dict, scaling: dict) -> YarnSpec:
    """transformers' _compute_yarn_parameters as megatron-core's YarnRotaryEmbedding's arguments."""
    original = int(scaling.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
    factor = float(scaling.get("factor") or cfg["max_position_embeddings"] / original)
    # transformers: mscale / mscale_all_dim only when both are given (and not 0), else yarn_get_mscale(factor);
    # megatron-core always divides by yarn_get_mscale(factor, mscale_all_dim), which is 1 at 0
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    mscale, all_dim = (float(mscale), float(all_dim)) if mscale and all_dim else (1.0, 0.0)
    attention = scaling.get("attention_factor")
    computed = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
    if attention is not None and float(attention) != computed:
        raise ConvertError(
            f"YaRN with attention_factor {attention}: megatron-core computes it from the factor and mscales "
            f"({computed!r} here) and has no flag for another value"
        )
    if float(scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise ConvertError("YaRN with partial_rotary_factor: megatron-core's YaRN rotates the whole head")
    return YarnSpec(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(scaling.get("beta_fast") or 32.0),  # transformers' defaults, for a missing or 0 value
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=mscale,
        mscale_all_dim=all_dim,
        round_to_int=bool(scaling.get("truncate", True)),
    )


def _divisible_by(tokenizer_vocab: int, model_vocab: int, tp: int) -> tuple[int, int]:
    """(--make-vocab-size-divisible-by, padded size): the largest power of two up to
    Megatron-LM's 128 that pads the tokenizer's count to the model's rows exactly; otherwise
    128, and the embedding is cut or zero-padded to that size."""
    for d in (128, 64, 32, 16, 8, 4, 2, 1):
        if pad_vocab_size(tokenizer_vocab, d, tp) == model_vocab:
            return d, model_vocab
    return 128, pad_vocab_size(tokenizer_vocab, 128, tp)


def _moe(cfg: dict, family: str, num_layers: int) -> MoESpec | None:
    """The experts of a Mixtral or Qwen3-MoE config; None for a dense family."""
    if family == "mixtral":
        if float(cfg.get("router_jitter_noise") or 0.0):
            raise ConvertError("Mixtral with router_jitter_noise: megatron-core's router has no jitter; set it to 0")
        # softmax, top-k, renormalised: megatron-core's top-k then softmax (the same probabilities)
        return MoESpec(
            num_experts=int(cfg["num_local_experts"]),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            topk=int(cfg["num_experts_per_tok"]),
            pre_softmax=False,
            layers=(True,) * num_layers,
        )
    if family == "qwen3_moe":
        step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
        # transformers' Qwen3MoeDecoderLayer: experts where the layer is not listed and (i + 1) % step == 0
        layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        return MoESpec(
            num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),  # transformers 5 writes the latter
            ffn_hidden_size=int(cfg["moe_intermediate_size"]),
            topk=int(cfg["num_experts_per_tok"]),
            pre_softmax=not cfg.get("norm_topk_prob", False),
            layers=layers,
        )
    if family == "deepseek_v3":
        return _deepseek_moe(cfg, num_layers)
    if family == "gpt_oss":  # top-k of the logits (router bias included), softmax over those k
        return MoESpec(
            num_experts=int(cfg["num_local_experts"]),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            topk=int(cfg.get("num_experts_per_tok") or cfg["experts_per_token"]),
            pre_softmax=False,
            layers=(True,) * num_layers,
        )
    return None


def _deepseek_moe(cfg: dict, num_layers: int) -> MoESpec:
    """DeepSeek-V3's router: sigmoid scores plus a correction bias for choosing, group-limited
    top-k, the chosen scores renormalised and scaled; shared experts beside the routed ones."""
    experts, topk = int(cfg.get("n_routed_experts") or cfg["num_local_experts"]), int(cfg["num_experts_per_tok"])
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if not cfg.get("norm_topk_prob", True) and topk > 1:
        raise ConvertError(
            "DeepSeek-V3 with norm_topk_prob false: megatron-core 0.16 renormalises sigmoid top-k scores always"
        )
    if groups > 1 and topk // group_topk != 2:
        # HF scores a group by its best 2 experts, megatron-core by its best topk // group_topk
        raise ConvertError(
            f"DeepSeek-V3 with num_experts_per_tok {topk} and topk_group {group_topk}: megatron-core scores a group "
            f"by its best {topk // group_topk} experts, transformers by its best 2"
        )
    shared = int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"])
    dense = int(cfg.get("first_k_dense_replace") or 0)
    return MoESpec(
        num_experts=experts,
        ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        topk=topk,
        pre_softmax=False,
        layers=tuple(i >= dense for i in range(num_layers)),
        shared_ffn_hidden_size=shared or None,
        sigmoid=True,
        expert_bias=True,
        num_groups=groups if groups > 1 else None,
        group_topk=group_topk if groups > 1 else None,
        scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
    )


def _mla(cfg: dict) -> MLASpec:
    """DeepSeek-V3's attention; its YaRN as megatron-core's MLA YaRN (some constants fixed there)."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    yarn = None
    if kind == "yarn":
        differ = {k: scaling.get(k) for k, v in MLA_YARN_FIXED.items() if float(scaling.get(k, v)) != v}
        if differ:
            raise ConvertError(
                f"YaRN with {differ}: Megatron-LM core_v0.16.1 has no flag for these (megatron-core's MLA fixes "
                f"{MLA_YARN_FIXED}); this model cannot be trained with the same positions"
            )
        yarn = (float(scaling["factor"]), float(scaling.get("mscale", 1.0)), float(scaling.get("mscale_all_dim", 0.0)))
    elif kind != "default":
        raise ConvertError(f"DeepSeek-V3 with RoPE scaling type {kind!r}: megatron-core's MLA has rope and yarn")
    if not cfg.get("rope_interleave", True):
        raise ConvertError("DeepSeek-V3 with rope_interleave false: megatron-core's MLA rotates interleaved pairs")
    q_lora = cfg.get("q_lora_rank")
    return MLASpec(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_pos_emb_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        yarn=yarn,
    )


def _gpt_oss(cfg: dict, num_layers: int) -> GptOssSpec:
    alpha = float(cfg.get("swiglu_alpha", GPT_OSS_ALPHA))
    if alpha != GPT_OSS_ALPHA:
        raise ConvertError(
            f"gpt-oss with swiglu_alpha {alpha}: megatron-core's quick-GeGLU fixes it at {GPT_OSS_ALPHA}"
        )
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]  # transformers' default
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ConvertError(f"gpt-oss with layer_types {sorted(unknown)}: only sliding_attention and full_attention")
    window = cfg.get("sliding_window")
    return GptOssSpec(
        window=int(window) if window else None,
        windowed=tuple(t == "sliding_attention" for t in types),
        clamp=float(cfg.get("swiglu_limit", 7.0)),
    )


def model_spec(
    cfg: dict,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    tokenizer_vocab: int | None = None,
    with_mtp: bool = False,
) -> ModelSpec:
    """The spec of ``cfg`` (a config.json dict), checked against the TP x PP (x VPP) x EP layout.
    ``with_mtp``: the weights hold DeepSeek-V3's MTP layers (transformers' own saves drop them)."""
    arch = (cfg.get("architectures") or ["?"])[0]
    family = cfg.get("model_type")
    if family in NOT_YET:
        raise ConvertError(f"{arch}: {NOT_YET[family]}")
    if family not in FAMILIES:
        raise ConvertError(
            f"unsupported architecture {arch} (model_type {family!r}): supported are "
            + ", ".join(f"{v} ({k})" for k, v in FAMILIES.items())
        )
    vocab = int(cfg["vocab_size"])
    tokenizer_vocab = vocab if tokenizer_vocab is None else tokenizer_vocab
    if tokenizer_vocab > vocab:
        raise ConvertError(
            f"the tokenizer has {tokenizer_vocab} tokens but the model's embedding has {vocab} rows: "
            "use the model's own tokenizer (or pass its size with --tokenizer-vocab-size)"
        )
    divisible_by, padded = _divisible_by(tokenizer_vocab, vocab, tp)
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise ConvertError(
            f"{arch} with quantized weights ({method}): dequantize them to bf16 first (the converter maps plain "
            "float32, bfloat16 or float16 tensors)"
        )
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConvertError(f"weights in {dtype}: only float32, bfloat16 and float16 models are converted")
    if family == "gpt2":
        heads, hidden = int(cfg["n_head"]), int(cfg["n_embd"])
        if cfg.get("activation_function", "gelu_new") != "gelu_new":
            raise ConvertError(f"GPT-2 with activation {cfg['activation_function']!r}: only gelu_new (--openai-gelu)")
        spec = ModelSpec(
            family=family,
            num_layers=int(cfg["n_layer"]),
            hidden_size=hidden,
            num_heads=heads,
            num_query_groups=heads,
            kv_channels=hidden // heads,
            ffn_hidden_size=int(cfg.get("n_inner") or 4 * hidden),
            vocab_size=vocab,
            padded_vocab_size=padded,
            make_vocab_size_divisible_by=divisible_by,
            max_position_embeddings=int(cfg["n_positions"]),
            norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
            tied_embeddings=True,
            qkv_bias=True,
            dtype=dtype,
        )
    else:
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConvertError(f"{arch} with hidden_act {cfg['hidden_act']!r}: only silu (--swiglu)")
        if family == "gpt_oss" and not cfg.get("attention_bias", True):
            raise ConvertError(
                f"{arch} with attention_bias false: gpt-oss's layers all have biases (--add-bias-linear)"
            )
        if family != "gpt_oss" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
            raise ConvertError(f"{arch} with attention_bias/mlp_bias: only the QKV bias of Qwen2 is mapped")
        heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        mla = _mla(cfg) if family == "deepseek_v3" else None
        # MLA's YaRN is its own (the llama3/linear scaling below is GPTModel's RotaryEmbedding)
        theta, llama3, linear, yarn = _rope({**cfg, "rope_scaling": None, "rope_parameters": {}}) if mla else _rope(cfg)
        if mla:
            theta = int((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
        num_layers = int(cfg["num_hidden_layers"])
        spec = ModelSpec(
            family=family,
            num_layers=num_layers,
            hidden_size=hidden,
            num_heads=heads,
            num_query_groups=heads if mla else int(cfg.get("num_key_value_heads") or heads),
            kv_channels=mla.v_head_dim if mla else int(cfg.get("head_dim") or hidden // heads),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            vocab_size=vocab,
            padded_vocab_size=padded,
            make_vocab_size_divisible_by=divisible_by,
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            norm_epsilon=float(cfg["rms_norm_eps"]),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rotary_base=theta,
            rope_scaling_factor=llama3,
            rope_linear_factor=linear,
            qkv_bias=family == "qwen2",
            qk_layernorm=family in QK_NORM or mla is not None,
            moe=_moe(cfg, family, num_layers),
            mla=mla,
            mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0) if with_mtp and mla else 0,
            dtype=dtype,
            gpt_oss=_gpt_oss(cfg, num_layers) if family == "gpt_oss" else None,
            yarn=yarn,
        )
    check_layout(spec, tp=tp, pp=pp, vpp=vpp, ep=ep)
    return spec


def layout_flags(spec: ModelSpec, *, tp: int, pp: int, vpp: int | None, ep: int) -> list[str]:
    """pretrain_gpt.py's layout flags (MoE under TP: megatron-core's MoE layer needs sequence parallelism, and
    biased experts expert TP 1)."""
    flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if vpp:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(spec.num_layers // (pp * vpp))]
    if ep > 1:
        flags += ["--expert-model-parallel-size", str(ep)]
    if spec.moe is not None and tp > 1:
        flags += ["--sequence-parallel"]
        if expert_tp(spec, tp) != tp:
            flags += ["--expert-tensor-parallel-size", str(expert_tp(spec, tp))]

    return flags


def expert_tp(spec: ModelSpec, tp: int) -> int:
    """The expert TP a layout trains at: megatron-core splits no expert bias (gpt-oss's experts: 1), else TP."""
    return 1 if spec.gpt_oss is not None else tp


def check_attention_window(cfg: dict, seq_length: int) -> None:
    """Sliding-window attention (Mistral) trains as full causal attention, which is the same
    only while no sequence is longer than the window: refuse a --seq-length past it. Dynamic NTK
    RoPE is plain RoPE up to the model's original length (transformers rescales past it)."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if scaling.get("rope_type", scaling.get("type")) == "dynamic":
        original = int(scaling.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
        if seq_length > original:
            raise ConvertError(
                f"dynamic NTK RoPE scaling at --seq-length {seq_length}: it rescales past {original} tokens, which "
                f"megatron-core's RotaryEmbedding cannot; convert and train with --seq-length {original} or less"
            )
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if window is not None and cfg.get("model_type") == "gpt_oss":  # its windows train as windows
        return
    if window is not None and window < seq_length:
        raise ConvertError(
            f"sliding-window attention ({window} tokens) at --seq-length {seq_length}: pretrain_gpt.py's attention "
            f"has no window, so it would differ; convert and train with --seq-length {window} or less"
        )


def check_layout(spec: ModelSpec, *, tp: int, pp: int, vpp: int | None, ep: int = 1) -> None:
    """What a TP x PP (x VPP) x EP layout must split evenly, named as config.json names it."""
    shape = ModelShape(
        spec.num_layers,
        spec.hidden_size,
        spec.num_heads,
        spec.num_query_groups,
        spec.kv_channels,
        spec.ffn_hidden_size,
        swiglu=not spec.gpt2,
    )
    try:
        shape.check_tensor_parallel(tp, names=GPT2_NAMES if spec.gpt2 else HF_NAMES)
    except LayoutError as error:
        raise ConvertError(str(error)) from None
    _check_experts(spec, tp=tp, ep=ep)
    _check_mla(spec, tp=tp)
    stages = pp * (vpp or 1)
    if spec.num_layers % stages:
        raise ConvertError(
            f"{spec.num_layers} layers are not divisible by --pp {pp}"
            + (f" x --vpp {vpp}" if vpp else "")
            + ": choose a layout that splits the layers evenly"
        )


def _check_experts(spec: ModelSpec, *, tp: int, ep: int) -> None:
    """EP splits the experts, expert TP (megatron-core's defaults to TP; 1 for biased experts) each expert's FFN."""
    if spec.moe is None:
        if ep != 1:
            raise ConvertError(f"--ep {ep} for a dense model ({spec.family} has no experts): use --ep 1")
        return
    experts = {"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts", "gpt_oss": "num_local_experts"}
    experts = experts.get(spec.family, "num_experts")
    if spec.moe.num_experts % ep:
        raise ConvertError(
            f"{experts} {spec.moe.num_experts} is not divisible by --ep {ep}: choose an EP size that divides the experts"
        )
    ffn = "intermediate_size" if spec.family in ("mixtral", "gpt_oss") else "moe_intermediate_size"
    if spec.moe.ffn_hidden_size % expert_tp(spec, tp):
        raise ConvertError(f"{ffn} {spec.moe.ffn_hidden_size} is not divisible by --tp {tp}")


def _check_mla(spec: ModelSpec, *, tp: int) -> None:
    """megatron-core's local MLA splits its down projections' outputs (the latent ranks) over TP too."""
    if spec.mla is None:
        return
    if spec.mla.q_lora_rank is not None and spec.mla.q_lora_rank % tp:
        raise ConvertError(f"q_lora_rank {spec.mla.q_lora_rank} is not divisible by --tp {tp}")
    kv = spec.mla.kv_lora_rank + spec.mla.qk_pos_emb_head_dim
    if kv % tp:
        raise ConvertError(f"kv_lora_rank + qk_rope_head_dim ({kv}) is not divisible by --tp {tp}")
