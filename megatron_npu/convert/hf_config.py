"""A Hugging Face ``config.json`` as the pretrain_gpt.py flags of the same model (no torch).

The raw JSON is read (not ``transformers.AutoConfig``) so the flags, and every refusal, come
before torch or megatron-core is imported. Both spellings of RoPE settings are read:
``rope_theta`` / ``rope_scaling`` (transformers 4) and ``rope_parameters`` (transformers 5).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from megatron_npu.layout.model_shape import ModelShape, pad_vocab_size
from megatron_npu.layout.parallel_dims import LayoutError

FAMILIES = {"llama": "LLaMA-2/3", "qwen2": "Qwen2/2.5", "mistral": "Mistral", "gpt2": "GPT-2"}
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
    dtype: str = "float32"

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
        if self.kv_channels * self.num_heads != self.hidden_size:
            f += ["--kv-channels", str(self.kv_channels)]
        if self.num_query_groups != self.num_heads:
            f += ["--group-query-attention", "--num-query-groups", str(self.num_query_groups)]
        if self.gpt2:
            f += ["--position-embedding-type", "learned_absolute", "--openai-gelu"]
        else:
            f += ["--position-embedding-type", "rope", "--rotary-base", str(self.rotary_base)]
            f += ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"]
            if self.qkv_bias:
                f += ["--add-qkv-bias"]
            if self.rope_scaling_factor is not None:
                f += ["--use-rope-scaling", "--rope-scaling-factor", repr(self.rope_scaling_factor)]
            if self.rope_linear_factor is not None:
                f += ["--rotary-seq-len-interpolation-factor", str(self.rope_linear_factor)]
        if not self.tied_embeddings:
            f += ["--untie-embeddings-and-output-weights"]
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


def _rope(cfg: dict) -> tuple[int, float | None, int | None]:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return int(theta), None, None
    if kind == "linear":  # HF divides the frequencies, megatron-core the positions: the same angles
        factor = float(scaling["factor"])
        if not factor.is_integer():
            raise ConvertError(
                f"linear RoPE scaling by {factor}: pretrain_gpt.py's --rotary-seq-len-interpolation-factor "
                "takes an integer"
            )
        return int(theta), None, int(factor)
    if kind == "llama3":
        differ = {k: scaling.get(k) for k, v in LLAMA3_FIXED.items() if float(scaling.get(k, v)) != v}
        if differ:
            raise ConvertError(
                f"llama3 RoPE scaling with {differ}: megatron-core 0.16 fixes {LLAMA3_FIXED}; this model cannot "
                "be trained with the same positions"
            )
        return int(theta), float(scaling["factor"]), None
    raise ConvertError(
        f"RoPE scaling type {kind!r} is not supported by megatron-core's GPTModel (default, linear, llama3 are)"
    )


def _divisible_by(tokenizer_vocab: int, model_vocab: int, tp: int) -> tuple[int, int]:
    """(--make-vocab-size-divisible-by, padded size): the largest power of two up to
    Megatron-LM's 128 that pads the tokenizer's count to the model's rows exactly; otherwise
    128, and the embedding is cut or zero-padded to that size."""
    for d in (128, 64, 32, 16, 8, 4, 2, 1):
        if pad_vocab_size(tokenizer_vocab, d, tp) == model_vocab:
            return d, model_vocab
    return 128, pad_vocab_size(tokenizer_vocab, 128, tp)


def model_spec(
    cfg: dict, *, tp: int = 1, pp: int = 1, vpp: int | None = None, tokenizer_vocab: int | None = None
) -> ModelSpec:
    """The spec of ``cfg`` (a config.json dict), checked against the TP x PP (x VPP) layout."""
    arch = (cfg.get("architectures") or ["?"])[0]
    family = cfg.get("model_type")
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
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ConvertError(f"{arch} with attention_bias/mlp_bias: only the QKV bias of Qwen2 is mapped")
        heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        theta, llama3, linear = _rope(cfg)
        spec = ModelSpec(
            family=family,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_query_groups=int(cfg.get("num_key_value_heads") or heads),
            kv_channels=int(cfg.get("head_dim") or hidden // heads),
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
            dtype=dtype,
        )
    check_layout(spec, tp=tp, pp=pp, vpp=vpp)
    return spec


def check_attention_window(cfg: dict, seq_length: int) -> None:
    """Sliding-window attention (Mistral) trains as full causal attention, which is the same
    only while no sequence is longer than the window: refuse a --seq-length past it."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if window is not None and window < seq_length:
        raise ConvertError(
            f"sliding-window attention ({window} tokens) at --seq-length {seq_length}: pretrain_gpt.py's attention "
            f"has no window, so it would differ; convert and train with --seq-length {window} or less"
        )


def check_layout(spec: ModelSpec, *, tp: int, pp: int, vpp: int | None) -> None:
    """What a TP x PP (x VPP) layout must split evenly, named as config.json names it."""
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
    stages = pp * (vpp or 1)
    if spec.num_layers % stages:
        raise ConvertError(
            f"{spec.num_layers} layers are not divisible by --pp {pp}"
            + (f" x --vpp {vpp}" if vpp else "")
            + ": choose a layout that splits the layers evenly"
        )
