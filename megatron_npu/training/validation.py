"""What Megatron-LM's ``validate_args`` does for GPT, plus the layout and path checks.

Fills derived values (ffn size, kv channels, query groups, data-parallel size, virtual
stages, p2p settings, dtypes ...) in place and raises ``ConfigError`` with a one-line
message naming the flags to change. Runs before any process group exists.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Callable
from typing import Any, TypeVar

from ..layout.model_shape import ModelShape
from ..layout.parallel_dims import TRAINER_FLAGS, LayoutError, ParallelDims, layout_stages
from ..policy import TOKENIZER_TYPES, ConfigError
from .data_checks import check_indexed_dataset
from .fsdp_args import check_fsdp_args
from .model_args import check_model_family_args
from .moe_args import check_moe_args
from .sections.model import REQUIRED_POSITIVE, check_required_positive
from .settings import SECTION_TYPES

T = TypeVar("T")

_SPM_TOKENIZERS = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def _layout(build: Callable[..., T], *args: Any) -> T:
    """Build a layout object, its LayoutError as the trainer's ConfigError (no traceback)."""
    try:
        return build(*args)
    except LayoutError as exc:
        raise ConfigError(str(exc)) from None


def _split_blend(tokens: list[str]) -> tuple[list[float] | None, list[str]]:
    """Megatron-LM's --data-path forms: prefixes, or weight-prefix pairs."""
    if len(tokens) >= 2 and len(tokens) % 2 == 0:
        try:
            weights = [float(t) for t in tokens[0::2]]
        except ValueError:
            return None, list(tokens)
        return weights, list(tokens[1::2])
    return None, list(tokens)


def _parse_rampup(values: list[str]) -> tuple[int, int, int]:
    if len(values) != 3:
        raise ConfigError(
            f"--rampup-batch-size takes 3 integers: <start batch size> <increment> <ramp-up samples>, got {len(values)}"
        )
    try:
        start, incr, samples = (int(v) for v in values)
    except ValueError:
        raise ConfigError(f"--rampup-batch-size {' '.join(values)}: expected 3 integers") from None
    return start, incr, samples


def _parse_step_schedule(values: list[str]) -> list[tuple[int, int]]:
    items = " ".join(values).replace(",", " ").split()
    out: list[tuple[int, int]] = []
    for item in items:
        try:
            it, gbs = item.split(":")
            out.append((int(it), int(gbs)))
        except ValueError:
            raise ConfigError(f"--step-batch-size-schedule: {item!r} is not ITER:GBS (e.g. '0:32 1000:64')") from None
    if not out:
        raise ConfigError("--step-batch-size-schedule: give at least one ITER:GBS pair")
    iters = [i for i, _ in out]
    if any(i < 0 for i in iters) or iters != sorted(set(iters)):
        raise ConfigError("--step-batch-size-schedule: iterations must be >= 0 and strictly increasing")
    if any(g <= 0 for _, g in out):
        raise ConfigError("--step-batch-size-schedule: global batch sizes must be positive")
    return out


def validate_args(
    args: argparse.Namespace, *, world_size: int, check_paths: bool = True, given: set[str] | None = None
) -> argparse.Namespace:
    """Megatron-LM's validate_args for GPT, plus layout and path checks; fills derived values in place."""
    given = given or set()
    warn = args.config_warnings if hasattr(args, "config_warnings") else []
    args.config_warnings = warn
    if not hasattr(args, "ignored_flags"):
        args.ignored_flags = []

    _check_unsupported(args)
    _check_deprecated(args)
    _derive_constants(args, world_size)
    _check_model_size(args)
    _derive_position_embeddings(args)
    check_model_family_args(args)
    if args.mtp_num_layers:
        from megatron_npu.compat import ReleaseGap, check_mtp_support

        try:  # megatron-core 0.12-0.15 lack what this trainer places and builds MTP with: said now
            check_mtp_support()
        except ReleaseGap as gap:
            raise ConfigError(str(gap)) from None

    # Model shape.
    if args.swiglu and args.squared_relu:
        raise ConfigError("--swiglu and --squared-relu are mutually exclusive; pick one")
    if (
        not args.group_query_attention
        and "--num-query-groups" in given
        and args.num_query_groups != args.num_attention_heads
    ):
        args.ignored_flags.append(("--num-query-groups", "ignored without --group-query-attention"))
    # one ModelShape: Megatron-LM's ffn (4h, SwiGLU 8h/3), kv-channel and query-group defaults
    shape = _layout(ModelShape.from_args, args)
    args.ffn_hidden_size, args.kv_channels = shape.ffn_hidden_size, shape.kv_channels
    args.num_query_groups = shape.num_query_groups

    _derive_moe(args, warn)
    _check_recompute(args)
    _derive_sequence_parallel(args, warn)
    _derive_weight_decay(args)
    _derive_precision(args)
    _check_schedule(args)
    _check_saving(args)
    _check_overlap(args)
    check_fsdp_args(args)
    _derive_data_sources(args, warn)
    _derive_tokenizer(args)
    _derive_sequence_lengths(args)
    _check_layout(args, world_size, shape)
    if check_paths:
        _check_paths(args)
    _derive_log_dir(args)
    _build_sections(args)
    return args


def _derive_log_dir(args: argparse.Namespace) -> None:
    """The timers JSON, layout.json and metrics.jsonl go to --log-dir, else --tensorboard-dir, else SAVE/logs."""
    if args.log_dir is None:
        args.log_dir = args.tensorboard_dir or (os.path.join(args.save, "logs") if args.save else None)
    if args.profile and args.log_dir is None:  # else the traces would have nowhere to go: not silently off
        raise ConfigError("--profile writes its traces to LOG_DIR/profile/: give --log-dir (or --tensorboard-dir)")


def _build_sections(args: argparse.Namespace) -> None:
    """The typed sections, from the validated values (each section checks its own invariants)."""
    for name, section in SECTION_TYPES.items():
        setattr(args, name, section.from_values(args))


def _check_unsupported(args: argparse.Namespace) -> None:
    """Flags this trainer refuses in combination (one-line reasons)."""
    if args.calculate_per_token_loss and args.ddp_average_in_collective:
        # megatron-core asserts the same inside DistributedDataParallel
        raise ConfigError(
            "--calculate-per-token-loss divides the gradients by the global batch's token count; "
            "it cannot be combined with --ddp-average-in-collective: drop one"
        )
    if args.wandb_project:
        _check_wandb(args)


def _check_deprecated(args: argparse.Namespace) -> None:
    """Deprecated Megatron-LM arguments (Megatron-LM asserts the same); removed from args."""
    for dest, flag, instead in (
        ("batch_size", "--batch-size", "--micro-batch-size"),
        ("warmup", "--warmup", "--lr-warmup-fraction or --lr-warmup-iters"),
        ("model_parallel_size", "--model-parallel-size", "--tensor-model-parallel-size"),
    ):
        if getattr(args, dest) is not None:
            raise ConfigError(f"{flag} is no longer valid; use {instead}")
        delattr(args, dest)
    if args.checkpoint_activations:
        raise ConfigError(
            "--checkpoint-activations is no longer valid; use --recompute-activations, or "
            "--recompute-granularity and --recompute-method"
        )
    del args.checkpoint_activations


def _derive_constants(args: argparse.Namespace, world_size: int) -> None:
    """Values Megatron-LM code reads from args that this trainer fixes."""
    args.rank = int(os.environ.get("RANK", "0"))
    args.world_size = world_size
    args.use_legacy_models = False
    args.use_mcore_models = True
    args.use_dist_ckpt = True  # torch_dist is the only format
    args.transformer_pipeline_model_parallel_size = args.pipeline_model_parallel_size
    if args.expert_tensor_parallel_size is None:  # Megatron-LM: expert TP defaults to TP
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    args.no_mmap_bin_files = not args.mmap_bin_files


def _check_model_size(args: argparse.Namespace) -> None:
    """Required model/batch arguments, positive (the parallel degrees are checked with the layout)."""
    check_required_positive(args, (*REQUIRED_POSITIVE, "seq_length", "micro_batch_size"))
    args.encoder_num_layers = args.num_layers
    args.encoder_seq_length = args.seq_length


def _derive_position_embeddings(args: argparse.Namespace) -> None:
    """Position embeddings: rope by flag, RoPE fusion only with rope, the max positions."""
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        raise ConfigError("--no-position-embedding is deprecated; use --position-embedding-type none (or rope)")
    if args.position_embedding_type != "rope":
        args.apply_rope_fusion = False
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > args.max_position_embeddings:
        raise ConfigError(
            f"--seq-length {args.seq_length} is larger than --max-position-embeddings "
            f"{args.max_position_embeddings} (learned absolute position embeddings); raise "
            "--max-position-embeddings or lower --seq-length"
        )


def _derive_moe(args: argparse.Namespace, warn: list[str]) -> None:
    """Megatron-LM's MoE checks and defaults (validate_args); the EP layout is ParallelDims'."""
    if args.num_experts == 0:
        args.num_experts = None
    # one-element lists collapse to the value, as Megatron-LM does
    for dest in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, dest)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, dest, value[0])
    if args.num_experts is None:
        return
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
        warn.append("moe_ffn_hidden_size is not set, using ffn_hidden_size for MoE instead.")
    if not 1 <= args.moe_router_topk <= args.num_experts:
        raise ConfigError(
            f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts {args.num_experts}"
        )
    freq = args.moe_layer_freq
    if isinstance(freq, list) and len(freq) != args.num_layers:
        raise ConfigError(f"--moe-layer-freq gives {len(freq)} layers; --num-layers is {args.num_layers}")
    if isinstance(freq, int) and freq < 1:
        raise ConfigError(f"--moe-layer-freq must be >= 1, got {freq}")
    # expert and router biases train (megatron_npu/patches/mappings.py makes the expert MLP's in-place
    # bias add legal, patches/moe_expert_bias.py their gradient under TP x SP; --moe-grouped-gemm runs biased
    # experts one by one), but not split over expert TP: TransformerConfig asserts "Bias in Moe is only supported
    # when ETP==1"
    if args.add_bias_linear and args.expert_tensor_parallel_size != 1:
        raise ConfigError(
            f"--num-experts with biases needs --expert-tensor-parallel-size 1 (it is "
            f"{args.expert_tensor_parallel_size}, which defaults to --tensor-model-parallel-size): megatron-core "
            "splits no expert bias over expert TP; or --disable-bias-linear"
        )
    check_moe_args(args)


def _check_recompute(args: argparse.Namespace) -> None:
    """Activation recomputation (Megatron-LM validate_args + TransformerConfig checks)."""
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    del args.recompute_activations
    if args.recompute_granularity == "selective" and args.recompute_method is not None:
        raise ConfigError(
            "--recompute-method is not supported with --recompute-granularity selective "
            "(or --recompute-activations); drop --recompute-method or use --recompute-granularity full"
        )
    if args.recompute_granularity == "full":
        if args.recompute_method is None:
            raise ConfigError("--recompute-granularity full needs --recompute-method uniform|block")
        if args.recompute_num_layers is None:
            raise ConfigError("--recompute-granularity full needs --recompute-num-layers")
    if args.distribute_saved_activations:
        if args.tensor_model_parallel_size == 1 or args.recompute_granularity != "full":
            raise ConfigError(
                "--distribute-saved-activations needs --tensor-model-parallel-size > 1 and --recompute-granularity full"
            )


def _derive_sequence_parallel(args: argparse.Namespace, warn: list[str]) -> None:
    """Sequence parallelism is off when TP is 1 (Megatron-LM warns and turns it off)."""
    if args.tensor_model_parallel_size == 1:
        if args.sequence_parallel:
            warn.append("--sequence-parallel turned off: --tensor-model-parallel-size is 1")
        args.sequence_parallel = False


def _derive_weight_decay(args: argparse.Namespace) -> None:
    """The weight-decay schedule's start and end."""
    if args.weight_decay_incr_style == "constant":
        if args.start_weight_decay is not None or args.end_weight_decay is not None:
            raise ConfigError("--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear|cosine")
        args.start_weight_decay = args.weight_decay
        args.end_weight_decay = args.weight_decay
    elif args.start_weight_decay is None or args.end_weight_decay is None:
        raise ConfigError(
            f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay "
            "and --end-weight-decay"
        )


def _derive_precision(args: argparse.Namespace) -> None:
    """Mixed precision: params dtype, grad-reduce dtype, the fusions and biases that follow."""
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are mutually exclusive; pick one (--bf16 on Ascend)")
    args.params_dtype = "float32"
    if args.fp16:
        args.params_dtype = "float16"
        if not args.loss_scale:
            # Dynamic loss scaling treats NaN/inf grads as a signal, as in Megatron-LM.
            args.check_for_nan_in_loss_and_grad = False
    if args.bf16:
        args.params_dtype = "bfloat16"
        if args.grad_reduce_in_bf16:
            args.accumulate_allreduce_grads_in_fp32 = False
        else:
            args.accumulate_allreduce_grads_in_fp32 = True
    if args.fp16_lm_cross_entropy and not args.fp16:
        raise ConfigError("--fp16-lm-cross-entropy needs --fp16")
    if args.fp32_residual_connection and not (args.fp16 or args.bf16):
        raise ConfigError("--fp32-residual-connection needs --fp16 or --bf16")
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True
    if not args.add_bias_linear:
        args.bias_gelu_fusion = False
    if args.add_bias_linear:
        args.add_qkv_bias = True


def _check_schedule(args: argparse.Namespace) -> None:
    """Training length and learning-rate schedule: iteration- or sample-based, consistently."""
    if args.train_iters is not None and args.train_samples is not None:
        raise ConfigError("--train-iters and --train-samples are mutually exclusive; give one")
    if args.train_iters is None and args.train_samples is None and not args.skip_train:
        raise ConfigError("give --train-iters (iteration-based) or --train-samples (sample-based training)")
    if args.train_iters:
        if args.lr_decay_samples is not None:
            raise ConfigError("--lr-decay-samples needs sample-based training; use --lr-decay-iters with --train-iters")
        if args.lr_warmup_samples:
            raise ConfigError(
                "--lr-warmup-samples needs sample-based training; use --lr-warmup-iters with --train-iters"
            )
        if args.rampup_batch_size is not None:
            raise ConfigError(
                "--rampup-batch-size needs sample-based training (as in Megatron-LM): use "
                "--train-samples instead of --train-iters, or drop --rampup-batch-size"
            )
        if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
            raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive; give one")
    if args.train_samples:
        if args.lr_decay_iters is not None:
            raise ConfigError(
                "--lr-decay-iters needs iteration-based training; use --lr-decay-samples with --train-samples"
            )
        if args.lr_warmup_iters:
            raise ConfigError(
                "--lr-warmup-iters needs iteration-based training; use --lr-warmup-samples with --train-samples"
            )
        if args.lr_warmup_fraction is not None and args.lr_warmup_samples:
            raise ConfigError("--lr-warmup-fraction and --lr-warmup-samples are mutually exclusive; give one")
    if args.lr is None and not args.skip_train:
        raise ConfigError("--lr is required")
    if args.lr is not None and args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if args.lr_decay_style == "WSD" and not args.skip_train:
        if args.train_iters and args.lr_wsd_decay_iters is None:
            raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters")
        if args.train_samples and args.lr_wsd_decay_samples is None:
            raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-samples")
    if not args.skip_train:
        _check_warmup_ends_before_decay(args)


def _check_warmup_ends_before_decay(args: argparse.Namespace) -> None:
    """What megatron-core's OptimizerParamScheduler asserts when it is built (after the process groups and the
    model): a decay length, a warmup shorter than it, a warmup start no higher than --lr."""
    unit = "iters" if args.train_iters else "samples"
    decay = (
        (args.lr_decay_iters or args.train_iters) if args.train_iters else (args.lr_decay_samples or args.train_samples)
    )
    warmup = args.lr_warmup_iters if args.train_iters else args.lr_warmup_samples
    if args.lr_warmup_fraction is not None:
        if not 0 <= args.lr_warmup_fraction < 1:
            raise ConfigError(f"--lr-warmup-fraction {args.lr_warmup_fraction} must be in [0, 1)")
    elif decay and warmup >= decay:
        decay_flag = f"--lr-decay-{unit}" if getattr(args, f"lr_decay_{unit}") else f"--train-{unit}"
        raise ConfigError(
            f"--lr-warmup-{unit} {warmup} leaves no decay: it must be below {decay_flag} {decay}; "
            f"lower --lr-warmup-{unit} or raise {decay_flag}"
        )
    if args.lr is not None and args.lr_warmup_init > args.lr:
        raise ConfigError(f"--lr-warmup-init {args.lr_warmup_init} is larger than --lr {args.lr}")


def _check_saving(args: argparse.Namespace) -> None:
    """--save needs an interval; retained checkpoints are a multiple of it."""
    if args.save is not None and (args.save_interval is None or args.save_interval <= 0):
        raise ConfigError("--save needs a positive --save-interval")
    if args.save_retain_interval is not None and (
        args.save_interval is None or args.save_retain_interval % args.save_interval != 0
    ):
        raise ConfigError("--save-retain-interval must be a multiple of --save-interval")
    if args.async_save and args.ckpt_format != "torch_dist":  # as Megatron-LM: its async writer is torch_dist's
        raise ConfigError(f"--async-save writes --ckpt-format torch_dist only: drop it with {args.ckpt_format}")
    if (args.save or args.load) and args.ckpt_format == "torch_dist":
        from megatron_npu.compat import ReleaseGap, check_checkpoint_support

        try:  # megatron-core 0.12-0.14 lack parts of the format: said now, not at the first save
            check_checkpoint_support(bool(args.use_distributed_optimizer))
        except ReleaseGap as gap:
            raise ConfigError(str(gap)) from None


def _check_overlap(args: argparse.Namespace) -> None:
    """Distributed optimizer / overlap."""
    if args.overlap_param_gather:
        if not (args.use_distributed_optimizer or args.use_megatron_fsdp):
            raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp)")
        if not args.overlap_grad_reduce:
            raise ConfigError("--overlap-param-gather needs --overlap-grad-reduce")


def _derive_data_sources(args: argparse.Namespace, warn: list[str]) -> None:
    """One data source; Megatron-LM's legacy split and dataloader defaults."""
    if args.data_path is not None and args.split is None:
        args.split = "969, 30, 1"  # Megatron-LM's legacy default
        warn.append('--split not given with --data-path: using Megatron-LM\'s legacy default "969, 30, 1"')
    per_split = any(p is not None for p in (args.train_data_path, args.valid_data_path, args.test_data_path))
    sources = int(bool(args.mock_data)) + int(bool(args.data_path)) + int(per_split)
    if sources > 1:
        raise ConfigError("give one data source: --data-path, or --train/valid/test-data-path, or --mock-data")
    if sources == 0 and not args.skip_train:
        raise ConfigError(
            "no training data: give --data-path PREFIX (build one with `megatron-npu preprocess`) or --mock-data"
        )
    if args.dataloader_type is None:
        args.dataloader_type = "single"


def _derive_tokenizer(args: argparse.Namespace) -> None:
    """The tokenizer type (GPT-2 BPE from vocab+merge files) and what it needs."""
    if args.tokenizer_type is None and args.vocab_file and args.merge_file:
        args.tokenizer_type = "GPT2BPETokenizer"  # what Megatron-LM's GPT examples mean without --tokenizer-type
    if args.tokenizer_type is None and not args.mock_data:
        raise ConfigError(f"--tokenizer-type is required (one of {', '.join(TOKENIZER_TYPES)})")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")


def _derive_sequence_lengths(args: argparse.Namespace) -> None:
    """Fixed-length samples (GPTDataset pads or packs to --seq-length). The run's counters
    (iteration, consumed samples), which Megatron-LM keeps on args, live in RunState."""
    args.variable_seq_lengths = False


def _pipeline_layout_problem(args: argparse.Namespace, stages: list[str], pp: int) -> str | None:
    """What megatron-core's PipelineParallelLayerLayout.validate_layer_layout asserts of the unrolled stages."""
    flat, mtp = "".join(stages), args.mtp_num_layers or 0
    unknown = sorted(set(flat) - set("EtmL"))
    holding = [v for v, stage in enumerate(stages) if "m" in stage]
    problems = (
        (unknown, f"has {''.join(unknown)}: a stage holds E (embedding), t (decoder layer), m (MTP layer), L (loss)"),
        (flat.count("E") != 1 or flat[:1] != "E", "must start with the embedding E, once"),
        (flat.count("L") != 1 or flat[-1:] != "L", "must end with the loss L, once"),
        (flat.count("t") != args.num_layers, f"has {flat.count('t')} t, --num-layers is {args.num_layers}"),
        (flat.count("m") != mtp, f"has {flat.count('m')} m, --mtp-num-layers is {mtp}"),
        (mtp and "t" in flat[flat.find("m") :], "places a decoder layer t after an MTP layer m"),
        (
            len(holding) > 1 or any(v < len(stages) - pp for v in holding),
            f"must hold every m in one of its last {pp} stages",
        ),
    )
    return next((said for failed, said in problems if failed), None)


def _check_pipeline_layout(args: argparse.Namespace, pp: int) -> None:
    """--pipeline-model-parallel-layout's rules, said before any process group: megatron-core 0.16.1 asserts them only
    building the model's TransformerConfig (validate_layer_layout), and its module imports torch, which this parser
    does not (the planner reads it)."""
    layout = args.pipeline_model_parallel_layout
    if layout is None:
        return
    flag = f"--pipeline-model-parallel-layout {layout!r}"
    others = {
        "--decoder-first-pipeline-num-layers": args.decoder_first_pipeline_num_layers is not None,
        "--decoder-last-pipeline-num-layers": args.decoder_last_pipeline_num_layers is not None,
        "--account-for-embedding-in-pipeline-split": args.account_for_embedding_in_pipeline_split,
        "--account-for-loss-in-pipeline-split": args.account_for_loss_in_pipeline_split,
    }
    if any(others.values()):  # megatron-core's TransformerConfig raises the same
        given = " ".join(name for name, set_ in others.items() if set_)
        raise ConfigError(f"{flag} places every layer, the embedding and the loss itself: drop {given}")
    problem = _pipeline_layout_problem(args, layout_stages(layout), pp)
    if problem:
        raise ConfigError(f"{flag} {problem}")


def _check_layout(args: argparse.Namespace, world_size: int, shape: ModelShape) -> None:
    """Parallel layout checks, before any process group exists: one ParallelDims, its rules."""
    dims = _layout(ParallelDims.from_args, args, world_size)
    tp, pp, dp, vpp = dims.tp, dims.pp, dims.dp, dims.vpp
    args.parallel, args.model_shape = dims, shape  # the typed layout and shape, owning their rules
    args.data_parallel_size = dp  # Megatron-LM's name, read by Megatron-LM-style code
    _layout(shape.check_tensor_parallel, tp, TRAINER_FLAGS.tp)
    # CP and SP split the sequence
    _layout(dims.check_seq_length, args.seq_length, args.sequence_parallel)
    # CP's comm types, hierarchical sizes and the heads its all-to-all splits; its attention has no dropout
    comm_types = [args.cp_comm_type] if isinstance(args.cp_comm_type, str) else list(args.cp_comm_type)
    sizes = args.hierarchical_context_parallel_sizes
    heads, groups = shape.num_attention_heads, shape.num_query_groups
    _layout(dims.check_context_parallel, comm_types, sizes, heads, groups, shape.num_layers)
    if dims.cp > 1 and args.attention_dropout:
        raise ConfigError(
            f"--context-parallel-size {dims.cp} runs attention without dropout: set --attention-dropout 0"
        )

    _check_pipeline_layout(args, pp)

    # Interleaved schedule (Megatron-LM validate_args): p2p settings follow from it.
    args.virtual_pipeline_model_parallel_size = vpp
    if args.microbatch_group_size_per_vp_stage is None:
        args.microbatch_group_size_per_vp_stage = pp
    if vpp is not None:
        from megatron_npu.compat import ReleaseGap, check_virtual_pipeline_support

        try:  # megatron-core 0.12 builds no virtual stages this trainer can drive: said now, not at model build
            check_virtual_pipeline_support()
        except ReleaseGap as gap:
            raise ConfigError(str(gap)) from None
        if not args.overlap_p2p_comm and pp <= 2:
            raise ConfigError(
                f"{dims.flags.vpp} with --no-overlap-p2p-communication needs --pipeline-model-parallel-size > 2"
            )
    else:
        args.overlap_p2p_comm = False  # only the interleaved schedule overlaps p2p
        args.align_param_gather = False
    args.batch_p2p_comm = not args.overlap_p2p_comm

    # Batch sizes.
    if args.micro_batch_size <= 0:
        raise ConfigError("--micro-batch-size must be positive")
    per_step = args.micro_batch_size * dp
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size <= 0:
        raise ConfigError("--global-batch-size must be positive")

    def _gbs_check(gbs: int, flag: str) -> None:
        _layout(dims.check_global_batch, gbs, args.micro_batch_size, args.microbatch_group_size_per_vp_stage, flag)

    _gbs_check(args.global_batch_size, "--global-batch-size")

    if args.rampup_batch_size is not None:
        start, incr, samples = _parse_rampup(args.rampup_batch_size)
        if start <= 0 or incr <= 0 or samples < 0:
            raise ConfigError("--rampup-batch-size: start and increment must be positive, ramp-up samples >= 0")
        diff = args.global_batch_size - start
        if diff < 0 or diff % incr != 0:
            raise ConfigError(
                f"--rampup-batch-size {start} {incr} {samples}: --global-batch-size "
                f"{args.global_batch_size} minus the start {start} must be a non-negative multiple of "
                f"the increment {incr}"
            )
        for value, what in ((start, "start"), (incr, "increment")):
            if value % per_step != 0:
                raise ConfigError(
                    f"--rampup-batch-size {what} {value} is not divisible by --micro-batch-size "
                    f"{args.micro_batch_size} x data-parallel size {dp} = {per_step}"
                )
        args.rampup_batch_size = [str(start), str(incr), str(samples)]

    if args.step_batch_size_schedule is not None:
        schedule = _parse_step_schedule(args.step_batch_size_schedule)
        if args.rampup_batch_size is not None:
            raise ConfigError("--step-batch-size-schedule and --rampup-batch-size are mutually exclusive")
        if not args.train_iters and not args.skip_train:
            raise ConfigError("--step-batch-size-schedule needs iteration-based training (--train-iters)")
        for _, gbs in schedule:
            _gbs_check(gbs, "--step-batch-size-schedule batch size")
        args.step_batch_size_schedule = schedule


def _check_wandb(args: argparse.Namespace) -> None:
    """Megatron-LM's wandb requirements, checked before any process group exists."""
    if not args.wandb_exp_name:
        raise ConfigError("--wandb-project needs --wandb-exp-name (Megatron-LM requires the run's name)")
    if not (args.wandb_save_dir or args.save):
        raise ConfigError("--wandb-project needs --wandb-save-dir, or --save (the run then goes to SAVE/wandb)")


def _check_paths(args: argparse.Namespace) -> None:
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb-project needs the wandb package: pip install wandb (or drop --wandb-project)")
    for flag, dest in (
        ("--data-path", "data_path"),
        ("--train-data-path", "train_data_path"),
        ("--valid-data-path", "valid_data_path"),
        ("--test-data-path", "test_data_path"),
    ):
        tokens = getattr(args, dest)
        if not tokens:
            continue
        weights, prefixes = _split_blend(tokens)
        if weights is not None and any(w < 0 for w in weights):
            raise ConfigError(f"{flag}: weights must be non-negative")
        for prefix in prefixes:
            missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                hint = ""
                if prefix.endswith((".bin", ".idx")):
                    hint = f" (a prefix names the files without the suffix: {prefix[:-4]})"
                raise ConfigError(
                    f"{flag} {prefix}: {' and '.join(prefix + e for e in missing)} not found{hint}; build the "
                    "dataset with `megatron-npu preprocess --input FILE.jsonl --output-prefix PREFIX ...`"
                )
            check_indexed_dataset(prefix, flag)  # truncated or corrupt: refused now, not mid-run
    if args.mock_data or args.tokenizer_type in (None, "NullTokenizer"):
        return
    t = args.tokenizer_type
    if t in _SPM_TOKENIZERS:
        _need_path(args.tokenizer_model, "--tokenizer-model", t, directory=False)
    elif t == "HuggingFaceTokenizer":
        _need_path(args.tokenizer_model, "--tokenizer-model", t, directory=None)
    elif t == "GPT2BPETokenizer":
        _need_path(args.vocab_file, "--vocab-file", t, directory=False)
        _need_path(args.merge_file, "--merge-file", t, directory=False)


def _need_path(path: str | None, flag: str, kind: str, *, directory: bool | None) -> None:
    if not path:
        raise ConfigError(f"--tokenizer-type {kind} needs {flag}")
    ok = os.path.exists(path) if directory is None else (os.path.isdir(path) if directory else os.path.isfile(path))
    if not ok:
        raise ConfigError(f"{flag} {path}: no such file (needed by --tokenizer-type {kind})")
