"""megatron_npu.training.arguments: Megatron-LM's GPT argument surface, read as a specification.

Fast, in-process: parse_args(argv, world_size=..., check_paths=...) and the ConfigError
messages. Fixtures in tests/fixtures/megatron_lm/ are the flag lists of NVIDIA's public
Megatron-LM example scripts.
"""

from __future__ import annotations

import ast
import shlex
import struct
from pathlib import Path

import pytest

from megatron_npu.training import arguments
from megatron_npu.training.arguments import ConfigError, parse_args

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_lm"

# A small valid GPT run; tests append or override flags (argparse: the last one wins).
BASE = [
    "--num-layers",
    "8",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "128",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
    "--mock-data",
]


def parse(*extra: str, world_size: int = 1, check_paths: bool = False, base: list[str] = BASE):
    return parse_args([*base, *extra], world_size=world_size, check_paths=check_paths)


def error(*extra: str, world_size: int = 1, check_paths: bool = False, base: list[str] = BASE) -> str:
    with pytest.raises(ConfigError) as info:
        parse(*extra, world_size=world_size, check_paths=check_paths, base=base)
    msg = str(info.value)
    assert "\n" not in msg.strip(), msg  # one line, no traceback-like dump
    return msg


def fixture(name: str) -> list[str]:
    return shlex.split((FIXTURES / name).read_text(), comments=True)


def without(tokens: list[str], prefix: str) -> list[str]:
    """tokens minus every flag starting with prefix and its values."""
    out, skip = [], False
    for tok in tokens:
        if tok.startswith("--"):
            skip = tok.startswith(prefix)
        if not skip:
            out.append(tok)
    return out


# ---------------------------------------------------------------------------------------
# Megatron-LM example scripts
# ---------------------------------------------------------------------------------------


def test_gpt3_175b_verbatim_hits_megatron_rampup_rule():
    # Megatron-LM's validate_args asserts "expected no batch-size rampup for iteration-based
    # training": its own 175B example trips over it; we say so in one line.
    msg = error(base=fixture("gpt3_175b.sh"), world_size=1024)
    assert "--rampup-batch-size" in msg and "--train-iters" in msg and "--train-samples" in msg


def test_gpt3_175b_accepted_without_rampup():
    args = parse_args(without(fixture("gpt3_175b.sh"), "--rampup-batch-size"), world_size=1024, check_paths=False)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (8, 16)
    assert args.data_parallel_size == 8
    assert args.num_attention_heads == 96 and args.num_query_groups == 96
    assert args.ffn_hidden_size == 4 * 12288 and args.kv_channels == 128
    assert args.global_batch_size == 1536 and args.micro_batch_size == 1
    assert args.fp16 and args.params_dtype == "float16"
    assert args.check_for_nan_in_loss_and_grad is False  # fp16 with dynamic loss scaling
    assert args.tokenizer_type == "GPT2BPETokenizer"  # vocab + merge files without --tokenizer-type
    assert args.split == "949,50,1" and args.data_path == ["/data/gpt3/my-gpt3_00_text_document"]
    assert args.lr == pytest.approx(6.0e-5) and args.lr_warmup_fraction == pytest.approx(0.001)
    assert args.position_embedding_type == "learned_absolute" and args.max_position_embeddings == 2048
    assert args.virtual_pipeline_model_parallel_size is None and args.overlap_p2p_comm is False
    assert args.transformer_impl == "local"
    assert ("--attention-backend", arguments.IGNORED["--attention-backend"]) in args.ignored_flags


def test_gpt3_175b_on_the_scripts_8_gpus_is_a_layout_error():
    msg = error(base=without(fixture("gpt3_175b.sh"), "--rampup-batch-size"), world_size=8)
    assert "world size 8" in msg and "--tensor-model-parallel-size 8" in msg
    assert "--pipeline-model-parallel-size 16" in msg and "= 128" in msg


def test_llama2_7b_accepted():
    args = parse_args(fixture("llama2_7b.sh"), world_size=16, check_paths=False)
    assert args.tensor_model_parallel_size == 8 and args.data_parallel_size == 2
    assert args.group_query_attention and args.num_query_groups == 32
    assert args.ffn_hidden_size == 11008 and args.kv_channels == 128
    assert args.position_embedding_type == "rope" and args.apply_rope_fusion is True
    assert args.swiglu and args.normalization == "RMSNorm"
    assert args.untie_embeddings_and_output_weights
    assert args.add_bias_linear is False and args.add_qkv_bias is False and args.bias_gelu_fusion is False
    assert args.masked_softmax_fusion is False and args.gradient_accumulation_fusion is False
    assert args.bf16 and args.params_dtype == "bfloat16" and args.accumulate_allreduce_grads_in_fp32
    assert args.sequence_parallel  # TP 8 keeps it
    assert args.use_distributed_optimizer and args.overlap_grad_reduce and args.overlap_param_gather
    assert args.no_save_optim is True and args.no_load_optim is True and args.no_load_rng is True
    assert args.eval_iters == -1  # the later flag wins, as in argparse
    assert args.distributed_backend == "nccl" and args.distributed_timeout_minutes == 120
    ignored = dict(args.ignored_flags)
    assert {"--use-mcore-models", "--no-async-tensor-model-parallel-allreduce", "--use-checkpoint-args"} <= set(ignored)


def test_llama2_7b_transformer_engine_fp8_variant_refused():
    # train_llama2.sh with TE_FP8=1 appends these.
    te = [
        "--transformer-impl=transformer_engine",
        "--fp8-margin=0",
        "--fp8-format=hybrid",
        "--fp8-interval=1",
        "--fp8-amax-history-len=1024",
        "--fp8-amax-compute-algo=max",
        "--attention-softmax-in-fp32",
    ]
    msg = error(*te, base=fixture("llama2_7b.sh"), world_size=16)
    assert "--fp8-margin" in msg and "fp8" in msg and "--bf16" in msg
    msg = error("--transformer-impl=transformer_engine", base=fixture("llama2_7b.sh"), world_size=16)
    assert "--transformer-impl transformer_engine" in msg
    assert "--transformer-impl local" in msg and "megatron-npu migrate" in msg


def test_llama3_8b_fp8_refused_and_bf16_variant_accepted():
    msg = error(base=fixture("llama3_8b_fp8.sh"), world_size=8)
    assert msg.startswith("--fp8-format") and "no fp8" in msg and "--bf16" in msg

    bf16 = without(fixture("llama3_8b_fp8.sh"), "--fp8")
    args = parse_args(bf16, world_size=8, check_paths=False)
    assert args.apply_layernorm_1p  # the recipe's zero-centered norm weights (ops/norm.py)
    assert args.num_query_groups == 8 and args.kv_channels == 128 and args.ffn_hidden_size == 14336
    assert args.rotary_base == 1000000 and args.position_embedding_type == "rope"
    assert args.train_samples == 1953125000 and args.train_iters is None
    assert args.data_parallel_size == 8 and args.global_batch_size == 128
    assert args.sequence_parallel is False  # TP 1: Megatron-LM turns it off with a warning
    assert any("--sequence-parallel" in w for w in args.config_warnings)
    assert args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32 is False
    assert args.tokenizer_type == "HuggingFaceTokenizer" and args.vocab_size == 128256
    assert args.mmap_bin_files is False and args.no_mmap_bin_files is True
    assert args.ckpt_format == "torch_dist" and args.context_parallel_size == 1
    assert args.decoupled_lr == pytest.approx(5.0e-4)
    assert "--use-mcore-models" in {f for f, _ in args.ignored_flags}
    assert args.training.manual_gc and "--manual-gc" not in {f for f, _ in args.ignored_flags}  # honoured


# ---------------------------------------------------------------------------------------
# Layout checks (world size known, before any process group exists)
# ---------------------------------------------------------------------------------------


def test_world_size_not_divisible_names_products():
    msg = error("--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2", world_size=12)
    assert "world size 12" in msg and "--tensor-model-parallel-size 4" in msg
    assert "--pipeline-model-parallel-size 2" in msg and "= 8" in msg
    assert "1, 2, 3, 4, 6, 12" in msg


def test_world_size_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse_args([*BASE], check_paths=False)
    assert args.world_size == 4 and args.data_parallel_size == 4 and args.global_batch_size == 8


def test_heads_divisible_by_tp():
    msg = error("--num-attention-heads", "6", "--hidden-size", "96", "--tensor-model-parallel-size", "4", world_size=4)
    assert "--num-attention-heads 6" in msg and "--tensor-model-parallel-size 4" in msg


def test_query_groups_divisible_by_tp():
    msg = error("--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "4", world_size=4)
    assert "--num-query-groups 2" in msg and "--tensor-model-parallel-size 4" in msg


def test_heads_divisible_by_query_groups():
    msg = error("--group-query-attention", "--num-query-groups", "3")
    assert "--num-attention-heads 8" in msg and "--num-query-groups 3" in msg


def test_layers_divisible_by_pp():
    msg = error("--num-layers", "6", "--pipeline-model-parallel-size", "4", world_size=4)
    assert "--num-layers 6" in msg and "--pipeline-model-parallel-size 4" in msg


def test_vpp_layers_per_stage_divisible():
    msg = error(
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "3",
        "--global-batch-size",
        "8",
        world_size=2,
    )
    assert "8 / 2 = 4" in msg and "--num-layers-per-virtual-pipeline-stage 3" in msg


def test_vpp_needs_pipeline_parallelism():
    msg = error("--num-layers-per-virtual-pipeline-stage", "4")
    assert "--num-layers-per-virtual-pipeline-stage" in msg and "--pipeline-model-parallel-size > 1" in msg
    msg = error(
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "2",
        "--no-overlap-p2p-communication",
        "--global-batch-size",
        "8",
        world_size=2,
    )
    assert "--no-overlap-p2p-communication" in msg and "> 2" in msg


def test_vpp_microbatch_count_in_range():
    # M = gbs / (mbs * dp) = 2 / (2 * 1) = 1 micro-batch, but the group size defaults to PP = 2.
    msg = error(
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "2",
        "--global-batch-size",
        "2",
        world_size=2,
    )
    assert "interleaved" in msg and "[PP=2, M=1]" in msg and "--global-batch-size 2" in msg


def test_vpp_microbatch_remainder():
    # PP 4, M = 6 micro-batches, groups of 4: remainder 2 < PP (megatron-core raises at step 1).
    msg = error(
        "--pipeline-model-parallel-size",
        "4",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "6",
        world_size=4,
    )
    assert "remainder of 2" in msg and "--microbatch-group-size-per-virtual-pipeline-stage 4" in msg


def test_vpp_derived_values():
    args = parse(
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "2",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "8",
        world_size=2,
    )
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.microbatch_group_size_per_vp_stage == 2
    assert args.overlap_p2p_comm is True and args.batch_p2p_comm is False
    args = parse(
        "--pipeline-model-parallel-size",
        "2",
        "--num-virtual-stages-per-pipeline-rank",
        "4",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "8",
        world_size=2,
    )
    assert args.virtual_pipeline_model_parallel_size == 4
    args = parse(
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "4",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "8",
        world_size=2,
    )
    assert args.virtual_pipeline_model_parallel_size is None  # one virtual stage = no interleaving
    assert args.overlap_p2p_comm is False and args.batch_p2p_comm is True
    msg = error(
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "2",
        "--num-virtual-stages-per-pipeline-rank",
        "2",
        world_size=2,
    )
    assert "mutually exclusive" in msg


def test_global_batch_divisible_by_micro_batch_times_dp():
    msg = error("--global-batch-size", "10", world_size=4)
    assert "--global-batch-size 10" in msg and "--micro-batch-size 2" in msg
    assert "data-parallel size 4" in msg and "= 8" in msg


def test_seq_length_beyond_learned_position_embeddings():
    msg = error("--max-position-embeddings", "64")
    assert "--seq-length 128" in msg and "--max-position-embeddings 64" in msg
    args = parse("--max-position-embeddings", "64", "--position-embedding-type", "rope")
    assert args.max_position_embeddings == 64


def test_train_iters_xor_train_samples():
    msg = error("--train-samples", "100")
    assert "--train-iters" in msg and "--train-samples" in msg
    no_length = [t for t in BASE if t not in ("--train-iters", "10")]
    msg = error(base=no_length)
    assert "--train-iters" in msg and "--train-samples" in msg
    assert parse("--skip-train", base=no_length).skip_train


def test_rampup_batch_size_consistency():
    samples = [t for t in BASE if t not in ("--train-iters", "10")] + ["--train-samples", "1000"]
    args = parse("--global-batch-size", "16", "--rampup-batch-size", "4", "4", "100", base=samples, world_size=2)
    assert args.rampup_batch_size == ["4", "4", "100"]
    msg = error("--global-batch-size", "16", "--rampup-batch-size", "4", "8", "100", base=samples, world_size=2)
    assert "--global-batch-size 16" in msg and "increment 8" in msg
    msg = error("--global-batch-size", "16", "--rampup-batch-size", "2", "2", "100", base=samples, world_size=2)
    assert "--rampup-batch-size start 2" in msg and "= 4" in msg
    msg = error("--rampup-batch-size", "4", "4", base=samples)
    assert "3 integers" in msg


def test_fp16_and_bf16_exclusive():
    msg = error("--fp16", "--bf16")
    assert "--fp16" in msg and "--bf16" in msg


def test_sequence_parallel_off_with_tp1():
    args = parse("--sequence-parallel")
    assert args.sequence_parallel is False
    assert args.config_warnings == ["--sequence-parallel turned off: --tensor-model-parallel-size is 1"]
    assert parse("--sequence-parallel", "--tensor-model-parallel-size", "2", world_size=2).sequence_parallel


def test_sequence_parallel_needs_seq_length_divisible_by_tp():
    msg = error(
        "--sequence-parallel",
        "--tensor-model-parallel-size",
        "4",
        "--seq-length",
        "126",
        "--max-position-embeddings",
        "128",
        world_size=4,
    )
    assert "--seq-length 126" in msg and "--tensor-model-parallel-size 4" in msg


def test_overlap_param_gather_requirements():
    msg = error("--overlap-param-gather")
    assert "--use-distributed-optimizer" in msg
    msg = error("--overlap-param-gather", "--use-distributed-optimizer")
    assert "--overlap-grad-reduce" in msg
    assert parse("--overlap-param-gather", "--use-distributed-optimizer", "--overlap-grad-reduce").overlap_param_gather


def test_step_batch_size_schedule():
    args = parse("--step-batch-size-schedule", "0:8", "5:16", world_size=2)
    assert args.step_batch_size_schedule == [(0, 8), (5, 16)]
    assert parse("--step-batch-size-schedule", "0:8 5:16").step_batch_size_schedule == [(0, 8), (5, 16)]
    msg = error("--step-batch-size-schedule", "0:8", "5:6", world_size=2)
    assert "--step-batch-size-schedule batch size 6" in msg and "= 4" in msg
    assert "ITER:GBS" in error("--step-batch-size-schedule", "5-16")
    assert "increasing" in error("--step-batch-size-schedule", "5:8", "2:16")


# ---------------------------------------------------------------------------------------
# Refused / ignored flags
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "named", "alternative"),
    [
        (["--fp8-format", "hybrid"], "--fp8-format", "--bf16"),
        (["--fp8-param-gather"], "--fp8-param-gather", "--bf16"),
        (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine", "local"),
        (["--tp-comm-overlap"], "--tp-comm-overlap", "drop"),
        (["--enable-cuda-graph"], "--enable-cuda-graph", "drop"),
        (["--external-cuda-graph"], "--external-cuda-graph", "drop"),
        (["--cuda-graph-warmup-steps", "3"], "--cuda-graph-warmup-steps", "drop"),
        (["--cuda-graph-impl", "local"], "--cuda-graph-impl local", "drop"),
        (["--use-custom-fsdp"], "--use-custom-fsdp", "--use-megatron-fsdp"),
        (["--fsdp-double-buffer"], "--fsdp-double-buffer", "--use-megatron-fsdp"),
        (["--ckpt-format", "torch"], "--ckpt-format torch", "torch_dist"),
        (["--ckpt-format=zarr"], "--ckpt-format zarr", "torch_dist"),
        (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type flex", "alltoall"),
        (["--moe-enable-deepep"], "--moe-enable-deepep", "alltoall"),
        (["--moe-use-upcycling"], "--moe-use-upcycling", "drop"),
        (["--use-legacy-models"], "--use-legacy-models", "drop"),
    ],
)
def test_refused_flags(flags, named, alternative):
    msg = error(*flags, world_size=2)
    assert msg.startswith(named) and "not supported" in msg and alternative in msg


def test_refused_table_rows_are_complete():
    assert all(r.flag.startswith("--") and r.reason and r.alternative for r in arguments.REFUSED)
    assert arguments.refusal_for("--fp8-anything").flag == "--fp8*"
    # one fp8 policy: every fp8/fp4 row (exact rows name migrate's rules) says the same
    assert len({(r.reason, r.alternative) for r in arguments.REFUSED if "fp8" in r.flag or "fp4" in r.flag}) == 1
    assert arguments.refusal_for("--moe-use-upcycling").flag == "--moe-*"
    assert arguments.refusal_for("--num-layers") is None
    # Refused-whenever-given flags are not accepted flags; value-checked ones are.
    assert "--fp8-format" not in arguments.known_flags() and "--ckpt-format" in arguments.known_flags()


def test_allowed_values_of_refused_flags_pass():
    args = parse(
        "--transformer-impl",
        "local",
        "--ckpt-format",
        "torch_dist",
        "--context-parallel-size",
        "1",
        "--expert-model-parallel-size",
        "1",
        "--num-experts",
        "0",
        "--cuda-graph-impl",
        "none",
    )
    assert args.transformer_impl == "local" and args.ckpt_format == "torch_dist" and args.use_dist_ckpt


def test_ignored_flags_recorded_once():
    args = parse(
        "--use-mcore-models", "--use-mcore-models", "--no-async-tensor-model-parallel-allreduce", "--use-dist-ckpt"
    )
    assert [f for f, _ in args.ignored_flags] == [
        "--use-mcore-models",
        "--no-async-tensor-model-parallel-allreduce",
        "--use-dist-ckpt",
    ]
    assert parse().ignored_flags == []
    # Not ignored: stored for the trainer.
    assert parse("--distributed-timeout-minutes", "30").distributed_timeout_minutes == 30
    assert parse("--use-flash-attn").use_flash_attn is True


def test_deprecated_megatron_flags():
    assert "--micro-batch-size" in error("--batch-size", "4")
    assert "--recompute-activations" in error("--checkpoint-activations")
    assert "--tensor-model-parallel-size" in error("--model-parallel-size", "2")


# ---------------------------------------------------------------------------------------
# Derived values and Megatron-LM dests
# ---------------------------------------------------------------------------------------


def test_derived_model_shape():
    args = parse()
    assert args.ffn_hidden_size == 256 and args.kv_channels == 8
    assert args.num_query_groups == 8 and args.max_position_embeddings == 128
    # Megatron-LM's swiglu rule: int((4h * 2/3) / 64) * 64.
    assert parse("--swiglu", "--hidden-size", "4096", "--num-attention-heads", "32").ffn_hidden_size == 10880
    assert parse("--swiglu").ffn_hidden_size == 128
    assert parse("--ffn-hidden-size", "100").ffn_hidden_size == 100
    assert parse("--kv-channels", "16").kv_channels == 16
    assert "--hidden-size 60" in error("--hidden-size", "60")


def test_derived_batch_and_parallel():
    args = parse(world_size=4)
    assert args.data_parallel_size == 4 and args.global_batch_size == 8
    args = parse("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", world_size=8)
    assert args.data_parallel_size == 2 and args.global_batch_size == 4
    assert args.virtual_pipeline_model_parallel_size is None
    assert args.overlap_p2p_comm is False and args.batch_p2p_comm is True
    assert args.microbatch_group_size_per_vp_stage == 2


def test_derived_precision():
    args = parse()
    assert args.params_dtype == "float32" and args.check_for_nan_in_loss_and_grad is True
    args = parse("--bf16")
    assert args.params_dtype == "bfloat16" and args.accumulate_allreduce_grads_in_fp32 is True
    args = parse("--fp16")
    assert args.params_dtype == "float16" and args.check_for_nan_in_loss_and_grad is False
    assert parse("--fp16", "--loss-scale", "1024").check_for_nan_in_loss_and_grad is True
    assert parse("--apply-query-key-layer-scaling").attention_softmax_in_fp32 is True
    assert "--fp16" in error("--fp16-lm-cross-entropy")
    assert args.initial_loss_scale == 2**32 and args.min_loss_scale == 1.0 and args.hysteresis == 2


def test_derived_misc():
    args = parse()
    assert args.start_weight_decay == args.end_weight_decay == 0.01
    assert args.add_qkv_bias is True  # add_bias_linear implies it, as in Megatron-LM
    assert args.position_embedding_type == "learned_absolute" and args.apply_rope_fusion is False
    assert parse("--use-rotary-position-embeddings").position_embedding_type == "rope"
    assert parse("--recompute-activations").recompute_granularity == "selective"
    assert "--recompute-method" in error("--recompute-granularity", "full")
    assert "--recompute-num-layers" in error("--recompute-granularity", "full", "--recompute-method", "uniform")
    assert "--recompute-method" in error("--recompute-activations", "--recompute-method", "block")
    assert (
        parse(
            "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.0", "--end-weight-decay", "0.1"
        ).end_weight_decay
        == 0.1
    )
    assert "--start-weight-decay" in error("--weight-decay-incr-style", "cosine")
    assert "--min-lr" in error("--min-lr", "1.0")
    assert "--save-interval" in error("--save", "/tmp/ckpt")
    assert args.dataloader_type == "single"  # (the run's counters are RunState's: tests/training/test_settings.py)


def test_a_warmup_that_leaves_no_decay_is_refused_before_megatron_core_asserts_it():
    """megatron-core's OptimizerParamScheduler asserts warmup < decay when it is built, after the model."""
    message = error("--train-iters", "5", "--lr-warmup-iters", "5")
    assert "--lr-warmup-iters 5" in message and "--train-iters 5" in message
    assert "--lr-decay-iters 4" in error("--train-iters", "10", "--lr-decay-iters", "4", "--lr-warmup-iters", "6")
    assert "--lr-warmup-fraction" in error("--lr-warmup-fraction", "1.0")
    assert "--lr-warmup-init" in error("--lr-warmup-init", "1.0")
    assert parse("--train-iters", "5", "--lr-warmup-iters", "4").lr_warmup_iters == 4


def test_megatron_defaults_and_dests():
    args = parse()
    assert args.transformer_impl == "local" and args.ckpt_format == "torch_dist"
    assert args.init_method_std == 0.02 and args.seed == 1234 and args.rotary_base == 10000
    assert args.attention_dropout == 0.1 and args.hidden_dropout == 0.1 and args.clip_grad == 1.0
    assert (args.adam_beta1, args.adam_beta2, args.adam_eps) == (0.9, 0.999, 1e-8)
    assert args.make_vocab_size_divisible_by == 128 and args.norm_epsilon == 1e-5
    assert args.eval_iters == 100 and args.eval_interval == 1000 and args.log_interval == 100
    assert args.num_workers == 2 and args.distributed_timeout_minutes == 10 and args.timing_log_level == 0
    assert args.lr_decay_style == "linear" and args.lr_warmup_iters == 0 and args.optimizer == "adam"
    assert args.no_save_optim is None and args.no_load_rng is None  # Megatron-LM: store_true, default None
    assert args.masked_softmax_fusion and args.bias_gelu_fusion and args.bias_swiglu_fusion
    assert args.bias_dropout_fusion and args.gradient_accumulation_fusion and args.overlap_p2p_comm is False
    assert args.log_dir is None and args.data_loader_delay_ms == 0.0 and args.yaml_cfg is None
    args = parse(
        "--disable-bias-linear",
        "--no-masked-softmax-fusion",
        "--no-bias-dropout-fusion",
        "--no-save-optim",
        "--no-load-optim",
        "--untie-embeddings-and-output-weights",
        "--no-gradient-accumulation-fusion",
        "--override-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        "--no-mmap-bin-files",
        "--log-dir",
        "/tmp/logs",
        "--data-loader-delay-ms",
        "25",
    )
    assert args.add_bias_linear is False and args.add_qkv_bias is False
    assert args.masked_softmax_fusion is False and args.bias_dropout_fusion is False
    assert args.no_save_optim is True and args.no_load_optim is True
    assert args.untie_embeddings_and_output_weights and args.gradient_accumulation_fusion is False
    assert args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler
    assert args.mmap_bin_files is False and args.no_mmap_bin_files is True
    assert args.log_dir == "/tmp/logs" and args.data_loader_delay_ms == 25.0
    dests = arguments.FLAG_DESTS
    assert dests["--microbatch-group-size-per-virtual-pipeline-stage"] == "microbatch_group_size_per_vp_stage"
    assert dests["--no-overlap-p2p-communication"] == "overlap_p2p_comm"
    assert dests["--no-rope-fusion"] == "apply_rope_fusion"


def test_data_path_blend_and_split_default():
    args = parse(
        "--data-path",
        "0.3",
        "/a",
        "0.7",
        "/b",
        base=[t for t in BASE if t != "--mock-data"] + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
    )
    assert args.data_path == ["0.3", "/a", "0.7", "/b"] and args.split == "969, 30, 1"
    assert "one data source" in error("--data-path", "/a")
    assert "--mock-data" in error(base=[t for t in BASE if t != "--mock-data"])


def test_tokenizer_requirements():
    real = [t for t in BASE if t != "--mock-data"] + ["--data-path", "/a"]
    assert "--tokenizer-type is required" in error(base=real)
    assert "--vocab-size" in error("--tokenizer-type", "NullTokenizer", base=real)
    from megatron_npu.data.tokenizers import TOKENIZER_TYPES

    assert arguments.TOKENIZER_TYPES == TOKENIZER_TYPES  # what build_tokenizer implements


# ---------------------------------------------------------------------------------------
# Paths (check_paths=True)
# ---------------------------------------------------------------------------------------


def _dataset(tmp_path: Path, name: str = "corpus_text_document") -> str:
    prefix = tmp_path / name
    (tmp_path / f"{name}.bin").write_bytes(b"")
    # an empty corpus's index (megatron-core's format: header, 0 sequences, document indices [0]):
    # the argument checks refuse a corrupt pair (megatron_npu/training/data_checks.py)
    (tmp_path / f"{name}.idx").write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<QBQQq", 1, 8, 0, 1, 0))
    return str(prefix)


REAL = [t for t in BASE if t != "--mock-data"]


def test_data_prefix_must_exist(tmp_path):
    missing = str(tmp_path / "nothing")
    msg = error(
        "--data-path", missing, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", base=REAL, check_paths=True
    )
    assert missing in msg and ".bin" in msg and ".idx" in msg and "megatron-npu preprocess" in msg
    prefix = _dataset(tmp_path)
    msg = error(
        "--data-path",
        prefix + ".bin",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
        base=REAL,
        check_paths=True,
    )
    assert "without the suffix" in msg
    args = parse(
        "--data-path",
        "0.5",
        prefix,
        "0.5",
        prefix,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
        base=REAL,
        check_paths=True,
    )
    assert args.data_path == ["0.5", prefix, "0.5", prefix]
    msg = error(
        "--train-data-path",
        prefix,
        "--valid-data-path",
        missing,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
        base=REAL,
        check_paths=True,
    )
    assert msg.startswith("--valid-data-path")


def test_tokenizer_files_must_exist(tmp_path):
    prefix = _dataset(tmp_path)
    msg = error(
        "--data-path",
        prefix,
        "--tokenizer-type",
        "GPTSentencePieceTokenizer",
        "--tokenizer-model",
        str(tmp_path / "spm.model"),
        base=REAL,
        check_paths=True,
    )
    assert "--tokenizer-model" in msg and "spm.model" in msg
    assert "--tokenizer-model" in error(
        "--data-path", prefix, "--tokenizer-type", "Llama2Tokenizer", base=REAL, check_paths=True
    )
    msg = error(
        "--data-path",
        prefix,
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(tmp_path / "vocab.json"),
        "--merge-file",
        str(tmp_path / "merges.txt"),
        base=REAL,
        check_paths=True,
    )
    assert "--vocab-file" in msg
    (tmp_path / "spm.model").write_bytes(b"x")
    parse(
        "--data-path",
        prefix,
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        str(tmp_path / "spm.model"),
        base=REAL,
        check_paths=True,
    )
    # Mock data needs no files; a missing --load directory only means "start from scratch".
    parse(
        "--tokenizer-type",
        "GPTSentencePieceTokenizer",
        "--tokenizer-model",
        "/nope.model",
        "--load",
        str(tmp_path / "no_ckpt"),
        check_paths=True,
    )


# ---------------------------------------------------------------------------------------
# YAML
# ---------------------------------------------------------------------------------------


def test_yaml_flat_and_sections(tmp_path):
    cfg = tmp_path / "gpt.yaml"
    cfg.write_text(
        "language_model:\n"
        "  num_layers: 4\n"
        "  hidden-size: 64\n"
        "  num_attention_heads: 4\n"
        "  layernorm_epsilon: 1.0e-6\n"
        "  disable_bias_linear: true\n"
        "  ffn_hidden_size: null\n"
        "model_parallel:\n"
        "  tensor_model_parallel_size: 2\n"
        "  fp8: null\n"
        "seq_length: 64\n"
        "micro_batch_size: 1\n"
        "train_iters: 5\n"
        "lr: 3.0e-4\n"
        "mock_data: true\n"
    )
    args = parse_args(["--yaml-cfg", str(cfg), "--train-iters", "7"], world_size=2, check_paths=False)
    assert args.num_layers == 4 and args.hidden_size == 64 and args.num_attention_heads == 4
    assert args.norm_epsilon == pytest.approx(1e-6) and args.lr == pytest.approx(3e-4)
    assert args.add_bias_linear is False and args.tensor_model_parallel_size == 2
    assert args.train_iters == 7  # the explicit flag wins over YAML
    assert args.ffn_hidden_size == 256 and args.data_parallel_size == 1


def test_yaml_list_values(tmp_path):
    cfg = tmp_path / "data.yaml"
    cfg.write_text("data_path: 0.5 /x 0.5 /y\nsplit: 98,2,0\n")
    args = parse("--yaml-cfg", str(cfg), base=REAL + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "9"])
    assert args.data_path == ["0.5", "/x", "0.5", "/y"] and args.split == "98,2,0"
    cfg.write_text("use_mcore_models: true\nmanual_gc: false\nprofile_ranks: [0, 3]\nbf16: true\n")
    args = parse("--yaml-cfg", str(cfg))
    assert [f for f, _ in args.ignored_flags] == ["--use-mcore-models"]
    assert args.profile_ranks == [0, 3] and args.bf16 and args.params_dtype == "bfloat16"
    cfg.write_text("bf16: yes please\n")
    assert "true/false" in error("--yaml-cfg", str(cfg))


def test_yaml_errors(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("language_model:\n  num_layerz: 4\n")
    msg = error("--yaml-cfg", str(cfg))
    assert "language_model.num_layerz" in msg and "unknown" in msg and "num_layers" in msg
    cfg.write_text("fp8_format: hybrid\n")
    msg = error("--yaml-cfg", str(cfg))
    assert "fp8_format" in msg and "--bf16" in msg
    cfg.write_text("transformer_impl: transformer_engine\n")
    assert "--transformer-impl transformer_engine" in error("--yaml-cfg", str(cfg))
    cfg.write_text("num_layers: many\n")
    assert "--num-layers" in error("--yaml-cfg", str(cfg))
    assert "no such file" in error("--yaml-cfg", str(tmp_path / "missing.yaml"))


# ---------------------------------------------------------------------------------------
# Parser surface
# ---------------------------------------------------------------------------------------


def test_unknown_and_abbreviated_flags():
    msg = error("--not-a-megatron-flag")
    assert "unrecognized arguments: --not-a-megatron-flag" in msg
    msg = error("--num-layer", "4")  # allow_abbrev=False, as in Megatron-LM
    assert "--num-layer" in msg and "did you mean --num-layers" in msg
    assert "invalid int value" in error("--num-layers", "four")


def test_known_flags_and_parser_groups():
    flags = arguments.known_flags()
    for flag in (
        "--tensor-model-parallel-size",
        "--disable-bias-linear",
        "--no-masked-softmax-fusion",
        "--no-save-optim",
        "--use-mcore-models",
        "--yaml-cfg",
        "--log-dir",
        "--data-loader-delay-ms",
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        "--save-interval",
    ):
        assert flag in flags
    titles = {g.title for g in arguments.build_parser()._action_groups}
    assert {
        "network size",
        "optimizer",
        "schedule",
        "training",
        "initialization",
        "checkpointing",
        "mixed precision",
        "distributed",
        "data and dataloader",
        "tokenizer",
        "logging",
        "profiling",
    } <= titles
    assert arguments.build_parser().allow_abbrev is False
    for flag in ("--log-dir", "--data-loader-delay-ms", "--step-batch-size-schedule"):
        action = next(a for a in arguments.build_parser()._actions if flag in a.option_strings)
        assert "megatron-npu extension" in action.help


@pytest.mark.parametrize("module", ["arguments.py", "validation.py", "../policy.py"])
def test_module_imports_no_torch_or_megatron(module):
    tree = ast.parse((Path(arguments.__file__).parent / module).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not any(m.split(".")[0] in ("torch", "megatron", "torch_npu", "megatron_npu") for m in names), names


# ---------------------------------------------------------------------------------------
# --distributed-backend: the accelerator says what runs it
# ---------------------------------------------------------------------------------------


def test_distributed_backend_goes_through_the_accelerator(monkeypatch):
    from megatron_npu import accelerator as acc
    from megatron_npu.accelerator.cpu import CpuAccelerator
    from megatron_npu.accelerator.cuda import CudaAccelerator

    # the cpu target (the tests' own) stands in for either device library
    for backend in ("nccl", "hccl", "gloo"):
        assert parse("--distributed-backend", backend, check_paths=True).distributed_backend == backend
        assert CpuAccelerator().collective_backend_for(backend) == "gloo"
    assert CpuAccelerator().collective_backend_for(None) == "gloo"
    # a target that cannot run the backend refuses it before any process group, in one line
    monkeypatch.setattr(acc, "_ACCELERATOR", CudaAccelerator())  # built without a GPU: only its table is read
    msg = error("--distributed-backend", "hccl", check_paths=True)
    assert msg.startswith("--distributed-backend hccl: the cuda target cannot run hccl") and "nccl" in msg
    assert parse("--distributed-backend", "gloo", check_paths=True).distributed_backend == "gloo"
    # the migration tool checks a script for another machine: no target check
    assert parse("--distributed-backend", "hccl").distributed_backend == "hccl"


# ---------------------------------------------------------------------------------------
# pretrain(extra_args_provider=..., args_defaults=...), as Megatron-LM's initialize_megatron
# ---------------------------------------------------------------------------------------


def test_extra_args_provider_flags_reach_get_args():
    from megatron_npu.training import loop
    from megatron_npu.training.global_vars import get_args, set_global

    def extra(parser):
        group = parser.add_argument_group(title="script")
        group.add_argument("--my-script-flag", type=int, default=3)
        return parser

    base = [*BASE, "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    args, _ = loop.setup_args([*base, "--my-script-flag", "7"], None, extra)  # what pretrain() calls
    set_global("args", args)
    assert get_args().my_script_flag == 7
    assert loop.setup_args(base, None, extra)[0].my_script_flag == 3
    assert "--my-script-flag" in error("--my-script-flag", "7")  # without the provider: unrecognized


def test_args_defaults_satisfy_a_required_flag_before_validation():
    base = [t for t in BASE if t != "--mock-data"] + ["--data-path", "unused"]
    assert "--tokenizer-type is required" in error(base=base)
    args = parse_args(
        base, world_size=1, check_paths=False, args_defaults={"tokenizer_type": "NullTokenizer", "vocab_size": 128}
    )
    assert args.tokenizer_type == "NullTokenizer"
    # a flag given on the command line wins over the script's default, as in Megatron-LM
    args = parse_args(
        [*base, "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"],
        world_size=1,
        check_paths=False,
        args_defaults={"vocab_size": 128},
    )
    assert args.vocab_size == 64


def test_upstream_megatron_lm_backend_goes_through_the_same_accelerator_question(capsys):
    """megatron_npu/patches/megatron_training.py maps Megatron-LM's --distributed-backend as this trainer does."""
    import argparse

    from megatron_npu.accelerator.cpu import CpuAccelerator
    from megatron_npu.accelerator.cuda import CudaAccelerator
    from megatron_npu.patches.megatron_training import adapt_args

    def adapted(backend: str, accelerator) -> argparse.Namespace:
        args = argparse.Namespace(transformer_impl="local", distributed_backend=backend)
        adapt_args(args, ["--distributed-backend", backend], accelerator)
        return args

    assert adapted("nccl", CpuAccelerator()).distributed_backend == "gloo"
    assert "--distributed-backend nccl: using gloo" in capsys.readouterr().err
    assert adapted("gloo", CudaAccelerator()).distributed_backend == "gloo"
    with pytest.raises(SystemExit) as stopped:
        adapted("hccl", CudaAccelerator())  # built without a GPU: only its table is read
    assert stopped.value.code == 2
    assert "megatron-npu: error: --distributed-backend hccl: the cuda target cannot run hccl" in capsys.readouterr().err


# ---- Megatron-LM core_v0.16.1 flags beyond GPT pretraining: answered, never unrecognised --------
# (tests/test_upstream_megatron_lm.py checks every flag of that tag's parser against this surface)
@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--rl-use-sequence-packing"], "a flag of Megatron-LM's reinforcement learning (GRPO) training"),
        (["--img-h", "224"], "a flag of Megatron-LM's vision models"),
        (["--qk-clip"], "QK-clip needs Transformer Engine >= 2.9"),
        (["--use-nccl-ub"], "CUDA-only"),
        (["--fim-data"], "this dataset option is not supported by this trainer; use --data-path"),
    ],
)
def test_megatron_lm_flags_of_other_workflows_are_refused_naming_why(flags, said):
    message = error(*flags)
    assert message.startswith(f"{flags[0]} is not supported: ") and said in message, message


def test_megatron_lm_telemetry_flags_are_accepted_and_reported_as_without_effect():
    args = parse("--no-one-logger", "--one-logger-project", "p", "--log-memory-interval", "10")
    assert [flag for flag, _ in args.ignored_flags] == [
        "--no-one-logger",
        "--one-logger-project",
        "--log-memory-interval",
    ]


def test_exit_signal_is_read_by_name_as_megatron_lm_does():
    import signal

    assert parse().exit_signal == signal.SIGTERM
    assert parse("--exit-signal-handler", "--exit-signal", "SIGUSR1").exit_signal == signal.SIGUSR1
    assert "'SIGFOO' is not a signal name" in error("--exit-signal", "SIGFOO")


def test_embedding_init_method_std_reaches_the_model_config():
    from megatron_npu.training.config import transformer_config

    assert transformer_config(parse("--embedding-init-method-std", "0.005")).embedding_init_method_std == 0.005
    assert transformer_config(parse("--init-method-std", "0.01")).embedding_init_method_std == 0.01
