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

from ...policy import ConfigError
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

    attention_backend: Literal["flash", "fused", "unfused", "local", "auto"] = "auto"
    """Attention backend (accepted; the device picks the kernel)."""

    kv_channels: int | None = None
    """Projection size per head; hidden-size // num-attention-heads if not given."""

    group_query_attention: bool = False
    """Use group-query attention."""

    num_query_groups: int | None = 1
    """Number of query groups under --group-query-attention (the heads share this many key/value heads)."""

    max_position_embeddings: int | None = None
    """Size of the position embedding; --seq-length if not given."""

    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute"
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

    normalization: Literal["LayerNorm", "RMSNorm"] = spec("LayerNorm", type=None)
    """Which normalization the layers use."""

    norm_epsilon: float = 1e-5
    """Epsilon for layer norm and RMS norm."""

    apply_layernorm_1p: bool = False
    """Zero-centered LayerNorm weights."""

    apply_residual_connection_post_layernorm: bool = False
    """Use original BERT residual connection ordering."""

    openai_gelu: bool = False
    """Use OpenAI's GeLU implementation."""

    squared_relu: bool = False
    """Use squared relu instead of gelu."""

    swiglu: bool = False
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

    def __post_init__(self) -> None:
        # TransformerConfig's own checks, for a section built without the trainer's validation
        # (which runs the same check first); the shape's rules are ModelShape's.
        check_required_positive(self, REQUIRED_POSITIVE)
