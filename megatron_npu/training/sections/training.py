"""The training section: activation recompute, kernel fusions, numerical checks and the step's
other switches (Megatron-LM core_v0.16.1's "training" group), and the replaced flags it refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...fates import FlagPolicy
from .base import Section, spec


@dataclass(frozen=True, kw_only=True)
class TrainingSection(Section):
    """Recompute, fusions, checks and the step's switches (Megatron-LM's training group; megatron-core's
    TransformerConfig and DistributedDataParallelConfig fields of the same names)."""

    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recompute: 'selective' checkpoints the submodules of --recompute-modules (default core_attn),
    'full' the whole transformer layer; none: every activation is kept."""

    recompute_method: Literal["uniform", "block"] | None = None
    """Which layers full recompute covers: uniform divides the layers into chunks of --recompute-num-layers and
    recomputes each chunk's input; block recomputes the first --recompute-num-layers layers of each pipeline stage."""

    recompute_num_layers: int | None = None
    """Layers per recompute chunk (uniform) or recomputed per pipeline stage (block)."""

    recompute_modules: tuple[str, ...] | None = spec(None, nargs="*")
    """The submodules selective recompute covers: core_attn, moe_act, layernorm, mla_up_proj, mlp, moe,
    shared_experts (default: core_attn)."""

    distribute_saved_activations: bool = False
    """If True, distribute recomputed activations across the model parallel group."""

    check_for_nan_in_loss_and_grad: bool = spec(True, "--no-check-for-nan-in-loss-and-grad")
    """Check for NaNs in loss and grad."""

    check_for_spiky_loss: bool = spec(
        False,
        fates=(
            FlagPolicy("--check-for-spiky-loss", "ignored", "the rerun state machine's spiky-loss check is not wired"),
        ),
    )
    """Check for spiky loss."""

    check_for_large_grads: bool = spec(
        False,
        fates=(
            FlagPolicy(
                "--check-for-large-grads", "ignored", "the rerun state machine's large-gradient check is not wired"
            ),
        ),
    )
    """Check for unexpectedly large grads."""

    clone_scatter_output_in_embedding: bool = spec(True, "--no-clone-scatter-output-in-embedding")
    """Clone the output of scatter_to_sequence_parallel_region in the embedding layer, so its input can be
    garbage collected."""

    use_cpu_initialization: bool | None = None
    """Initialize weights on the CPU (the same weights whatever the tensor parallelism)."""

    empty_unused_memory_level: Literal[0, 1, 2] = spec(
        0,
        fates=(
            FlagPolicy(
                "--empty-unused-memory-level", "ignored", "the device allocator cache is not emptied per iteration"
            ),
        ),
    )
    """Empty the device's allocator cache each iteration (training and eval) against fragmentation: 0 off,
    1 moderate, 2 aggressive."""

    deterministic_mode: bool = False
    """Choose deterministic code paths: slower, good for debugging and testing."""

    check_weight_hash_across_dp_replicas_interval: int | None = spec(
        None,
        fates=(FlagPolicy("--check-weight-hash-across-dp-replicas-interval", "ignored", "DP replicas are not hashed"),),
    )
    """Interval to check that weight hashes are the same across DP replicas; none: not checked."""

    calculate_per_token_loss: bool = False
    """Divide the cross-entropy loss by the global batch's count of non-padded tokens instead of assuming every
    token counts."""

    train_sync_interval: int | None = spec(
        None,
        fates=(
            FlagPolicy(
                "--train-sync-interval",
                "ignored",
                "the host synchronises with the device once per iteration (for the timers)",
            ),
        ),
    )
    """Training CPU-GPU synchronization interval, to ensure that CPU is not running too far ahead of GPU."""

    masked_softmax_fusion: bool = spec(True, "--no-masked-softmax-fusion")
    """Disable fusion of query_key_value scaling, masking, and softmax."""

    bias_gelu_fusion: bool = spec(True, "--no-bias-gelu-fusion")
    """Disable bias and gelu fusion."""

    bias_swiglu_fusion: bool = spec(True, "--no-bias-swiglu-fusion")
    """Disable bias and swiglu fusion."""

    bias_dropout_fusion: bool = spec(True, "--no-bias-dropout-fusion")
    """Disable bias and dropout fusion."""

    apply_rope_fusion: bool = spec(
        True,
        "--no-rope-fusion",
        opposite=("--apply-rope-fusion", "Legacy spelling (rope fusion is on by default)."),
        fates=(
            FlagPolicy(
                "--apply-rope-fusion",
                "mapped",
                "runs as torch_npu.npu_rotary_mul on NPU",
                migrate="note",
                name="rope-fusion",
            ),
        ),
    )
    """Disable rope fusion."""

    cross_entropy_loss_fusion: bool = False
    """Use the fused cross-entropy implementation."""

    use_flash_attn: bool = spec(
        False,
        fates=(
            FlagPolicy(
                "--use-flash-attn",
                "mapped",
                "runs as torch_npu.npu_fusion_attention on NPU",
                migrate="note",
                name="flash-attn",
            ),
        ),
    )
    """Use a flash attention kernel."""

    async_tensor_model_parallel_allreduce: bool = spec(
        True,
        "--no-async-tensor-model-parallel-allreduce",
        "--disable-async-tensor-model-parallel-allreduce",
        fates=(
            FlagPolicy("--no-async-tensor-model-parallel-allreduce", "ignored", "deprecated in Megatron-LM; no effect"),
            FlagPolicy(
                "--disable-async-tensor-model-parallel-allreduce", "ignored", "deprecated in Megatron-LM; no effect"
            ),
        ),
    )
    """Deprecated; ignored."""

    no_persist_layer_norm: bool = spec(
        False,
        fates=(
            FlagPolicy("--no-persist-layer-norm", "ignored", "there is no persistent layer-norm kernel on this target"),
        ),
    )
    """Disable the persistent fused layer norm kernel."""

    sequence_parallel: bool = False
    """Enable sequence parallelism: layer norms and dropout split over the tensor-parallel ranks along the
    sequence."""

    gradient_accumulation_fusion: bool = spec(True, "--no-gradient-accumulation-fusion")
    """Disable fusing gradient accumulation to weight gradient computation of linear layers."""

    deprecated_use_mcore_models: bool = spec(
        False,
        "--use-mcore-models",
        fates=(FlagPolicy("--use-mcore-models", "ignored", "megatron-core models are always used"),),
    )
    """Deprecated no-op: megatron-core models are always used."""

    manual_gc: bool = False
    """Disable the threshold-based garbage collector and collect at chosen points instead, the same on every
    rank (training/garbage_collection.py)."""

    manual_gc_interval: int = 0
    """Training step interval to trigger manual garbage collection (0: none between steps)."""

    manual_gc_eval: bool = spec(True, "--no-manual-gc-eval", "--disable-manual-gc-eval")
    """Under manual garbage collection, no collection at the start and end of each evaluation."""


@dataclass(frozen=True, kw_only=True)
class ReplacedFlags(Section):
    """Flags validation replaces: refused when given (deprecated) or turned into others, then removed from the
    settings; no component reads them, so no ``Settings`` member holds them."""

    batch_size: int | None = None
    """Old batch size parameter, do not use (--micro-batch-size)."""

    warmup: int | None = None
    """Old lr warmup argument, do not use (--lr-warmup-fraction or --lr-warmup-iters)."""

    model_parallel_size: int | None = None
    """Old model parallel argument, do not use (--tensor-model-parallel-size)."""

    checkpoint_activations: bool = False
    """Deprecated; do not use (--recompute-activations)."""

    recompute_activations: bool = False
    """Recompute activations (selective granularity): --recompute-granularity selective."""
