"""The model section: the network's size, attention, position embeddings, normalization, activation,
biases, dropout and initialisation (Megatron-LM's "network size", "regularization" dropout and
"initialization" flags; megatron-core's ``TransformerConfig`` fields of the same names).

A field here is a flag (``base.py`` generates it); a model-family flag is added as a field with its
doc. Validation fills the values left unset (ffn / kv-channel / query-group sizes from ``ModelShape``,
``max_position_embeddings`` from ``--seq-length``) before the section is built, so a built section
holds the model as it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...fates import ConfigError, FlagPolicy
from ...layout.moe import moe_freq_type
from ..model_args import tuple_type
from .base import Section, spec

#: what a model needs given, each a positive whole number
REQUIRED_POSITIVE = ("num_layers", "hidden_size", "num_attention_heads")


def check_required_positive(values: object, names: tuple[str, ...]) -> None:
    """``--flag is required`` / ``must be positive`` for each of ``names`` (attributes of ``values``)."""
    for name in names:
        if getattr(values, name) is None:
            raise ConfigError(f"--{name.replace('_', '-')} is required")
    for name in names:
        if getattr(values, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(values, name)}")


@dataclass(frozen=True, kw_only=True)
class ModelSection(Section):
    """Network size and architecture (Megatron-LM's network size, dropout and initialization flags)."""

    num_layers: int | None = None
    """Number of transformer layers."""

    hidden_size: int | None = None
    """Transformer hidden size."""

    ffn_hidden_size: int | None = None
    """Feed-forward hidden size; 4*hidden-size (int(8*h/3/64)*64 with --swiglu) if not given."""

    num_attention_heads: int | None = None
    """Number of attention heads."""

    attention_backend: Literal["flash", "fused", "unfused", "local", "auto"] = spec(
        "auto",
        fates=(
            FlagPolicy(
                "--attention-backend",
                "ignored",
                "this trainer's attention is its local one, fused (npu_fusion_attention on NPU) under --use-flash-attn; `megatron-npu migrate` rewrites --attention-backend fused / flash to it",
                allowed=("fused", "flash"),
                migrate="replace",
                name="attention-backend",
                rewrite="--use-flash-attn",
                takes_value=True,
            ),
        ),
    )
    """Attention backend (accepted; the device picks the kernel)."""

    kv_channels: int | None = None
    """Projection size per head; hidden-size // num-attention-heads if not given."""

    group_query_attention: bool = False
    """Use group-query attention."""

    num_query_groups: int | None = 1
    """Number of query groups under --group-query-attention (the heads share this many key/value heads)."""

    max_position_embeddings: int | None = None
    """Size of the position embedding; --seq-length if not given."""

    position_embedding_type: Literal["learned_absolute", "rope", "yarn", "none"] = "learned_absolute"
    """Position embedding type."""

    use_rotary_position_embeddings: bool = False
    """Deprecated: use --position-embedding-type rope."""

    rotary_base: int = 10000
    """Base of rotary embeddings."""

    rotary_percent: float = 1.0
    """Percent of rotary dimension to use."""

    rotary_interleaved: bool = False
    """Use interleaved rotary embedding."""

    rotary_seq_len_interpolation_factor: int | None = None
    """Sequence length interpolation factor for rotary embeddings."""

    use_rope_scaling: bool = False
    """Apply rope scaling as used in llama3.x."""

    rope_scaling_factor: float = 8.0
    """Rope scaling factor (llama3.x)."""

    add_position_embedding: bool = spec(True, "--no-position-embedding")
    """Deprecated: use --position-embedding-type."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocab size to be divisible by this value."""

    normalization: Literal["LayerNorm", "RMSNorm"] = spec(
        "LayerNorm",
        type=None,
        fates=(
            FlagPolicy(
                "--normalization",
                "mapped",
                "RMSNorm runs as torch_npu.npu_rms_norm on NPU",
                allowed=("RMSNorm",),
                migrate="note",
                name="rmsnorm",
            ),
        ),
    )
    """Which normalization the layers use."""

    norm_epsilon: float = 1e-5
    """Epsilon for layer norm and RMS norm."""

    apply_layernorm_1p: bool = False
    """Zero-centered norm weights: stored as gamma - 1 and applied as 1 + weight (ops/norm.py)."""

    apply_residual_connection_post_layernorm: bool = False
    """Use original BERT residual connection ordering."""

    openai_gelu: bool = False
    """Use OpenAI's GeLU implementation."""

    squared_relu: bool = False
    """Use squared relu instead of gelu."""

    swiglu: bool = spec(
        False,
        fates=(
            FlagPolicy(
                "--swiglu",
                "mapped",
                "the SwiGLU activation runs as torch_npu.npu_swiglu on NPU",
                migrate="note",
                name="swiglu",
            ),
        ),
    )
    """Use gated linear units and SiLU."""

    untie_embeddings_and_output_weights: bool = False
    """Untie embeddings and output weights."""

    attention_dropout: float = 0.1
    """Post attention dropout probability."""

    hidden_dropout: float = 0.1
    """Dropout probability for hidden state."""

    init_method_std: float = 0.02
    """Standard deviation of the zero mean normal distribution used for weight initialization."""

    embedding_init_method_std: float | None = None
    """Std of the embedding's initialisation (default: --init-method-std)."""

    init_method_xavier_uniform: bool = False
    """Initialize the weights with Xavier uniform instead of the normal distribution."""

    add_bias_linear: bool = spec(True, "--disable-bias-linear")
    """Disable bias in the linear layers."""

    add_qkv_bias: bool = False
    """Enable bias only in the QKV linear layers."""

    qk_layernorm: bool = False
    """Layer-normalize q and k."""

    # ---- model families (Megatron-LM core_v0.16.1's _add_mla_args, its network-size and distributed
    # groups, and the flags it generates from TransformerConfig; training/model_args.py checks them)
    multi_latent_attention: bool = False
    """Use multi-latent attention (MLA; megatron-core's MLATransformerConfig)."""

    q_lora_rank: int | None = None
    """Rank of the query's low-rank representation (MLA; none: a full query projection)."""

    kv_lora_rank: int = 32
    """Rank of the key and value's low-rank representation (MLA)."""

    qk_head_dim: int = 128
    """Dimension of the head in the QK projection (MLA; q_head_dim = qk_head_dim + qk_pos_emb_head_dim)."""

    qk_pos_emb_head_dim: int = 64
    """Dimension of the position embedding in the QK projection (MLA)."""

    v_head_dim: int = 128
    """Dimension of the head in the V projection (MLA)."""

    rotary_scaling_factor: float = 1.0
    """Rotary scaling factor for the rotary embeddings (YaRN: MLA's, and --position-embedding-type yarn's)."""

    mscale: float = 1.0
    """Mscale for YaRN RoPE in multi-latent attention (and --position-embedding-type yarn)."""

    mscale_all_dim: float = 0.0
    """Mscale all dimensions for YaRN RoPE in multi-latent attention (and --position-embedding-type yarn)."""

    rope_type: Literal["rope", "yarn"] | None = None
    """Type of rope to use: MLA takes yarn by default, other attention rope."""

    # YaRN on standard attention (--position-embedding-type yarn): Megatron-LM core_v0.19.0's flags, with
    # --rotary-scaling-factor, --mscale and --mscale-all-dim; core_v0.16.1 has none for standard attention
    yarn_original_max_position_embeddings: int | None = spec(None, extension=True)
    """Original maximum position embeddings for YaRN RoPE frequency correction (Megatron-LM core_v0.19.0's
    flag; none: 4096)."""

    yarn_beta_fast: float | None = spec(None, extension=True)
    """Beta fast for YaRN RoPE frequency correction (Megatron-LM core_v0.19.0's flag; none: 32)."""

    yarn_beta_slow: float | None = spec(None, extension=True)
    """Beta slow for YaRN RoPE frequency correction (Megatron-LM core_v0.19.0's flag; none: 1)."""

    yarn_correction_range_round_to_int: bool | None = spec(
        None,
        extension=True,
        opposite=(
            "--no-yarn-correction-range-round-to-int",
            "[megatron-npu extension] Do not round YaRN correction range endpoints to integers (Hugging Face's "
            "truncate false; Megatron-LM core_v0.19.0's flag).",
        ),
    )
    """Round YaRN correction range endpoints to integers (Megatron-LM core_v0.19.0's flag; none: round)."""

    mtp_num_layers: int | None = None
    """Number of multi-token prediction (MTP) layers; none: no MTP."""

    mtp_loss_scaling_factor: float = 0.1
    """Scaling factor of the MTP loss (the mean over the MTP layers' losses times this)."""

    window_size: object | None = spec(None, type=tuple_type, nargs=None)
    """Window size for window attention (left,right); none: window attention disabled."""

    window_attn_skip_freq: object | None = spec(None, type=moe_freq_type)
    """Layers without window attention: N, one full-attention layer after N-1 window layers; or a list (1 = window)."""

    no_rope_freq: object | None = spec(None, type=moe_freq_type)
    """Layers without RoPE: N, RoPE skipped on every N-th layer; or a list (1 = no RoPE)."""

    softmax_type: Literal["vanilla", "off-by-one", "learnable"] = "vanilla"
    """Softmax of the attention: vanilla, off-by-one or learnable (attention sinks)."""

    quick_geglu: bool = False
    """Use quick geglu activation instead of default gelu (gpt-oss)."""

    glu_linear_offset: float = 0.0
    """Offset added to the linear half of a gated linear unit (gpt-oss: 1.0)."""

    activation_func_clamp_value: float | None = None
    """Clamp of the gated linear unit's inputs (gpt-oss: 7.0)."""

    decoder_first_pipeline_num_layers: int | None = None
    """Transformer layers on the first pipeline stage; none: an even split."""

    decoder_last_pipeline_num_layers: int | None = None
    """Transformer layers on the last pipeline stage; none: an even split."""

    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one layer when splitting the layers over pipeline stages."""

    account_for_loss_in_pipeline_split: bool = False
    """Count the loss as one layer when splitting the layers over pipeline stages."""

    pipeline_model_parallel_layout: str | None = None
    """Custom layout of the layers over stages, e.g. "E|(t|)*3,m|m||L" (E embedding, t layer, m MTP, L loss)."""

    def __post_init__(self) -> None:
        # TransformerConfig's own checks, for a section built without the trainer's validation
        # (which runs the same check first); the shape's rules are ModelShape's.
        check_required_positive(self, REQUIRED_POSITIVE)
