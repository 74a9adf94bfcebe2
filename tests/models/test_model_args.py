"""The model families' flags in pretrain_gpt.py's parser: Megatron-LM core_v0.16.1's defaults, megatron-core's
configs built from them, and the one-line errors before any process group."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_npu.policy import ConfigError, refusal_for
from megatron_npu.training.arguments import parse_args

BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128 --lr 1e-3 --train-iters 1 --position-embedding-type rope"
).split()

#: flags Megatron-LM generates from TransformerConfig: the same default as the dataclass field
GENERATED = (
    "multi_latent_attention",
    "mtp_num_layers",
    "mtp_loss_scaling_factor",
    "softmax_type",
    "glu_linear_offset",
    "activation_func_clamp_value",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "window_size",
    "window_attn_skip_freq",
    "no_rope_freq",
    "pipeline_model_parallel_layout",
    "qk_layernorm",
)


def parse(*flags: str, world_size: int = 1):
    return parse_args([*BASE, *flags], world_size=world_size, check_paths=False)


def test_defaults_are_megatron_lms():
    from megatron.core.transformer import TransformerConfig

    args = parse()
    fields = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    for name in GENERATED:
        assert getattr(args, name) == fields[name], name
    # _add_mla_args' own defaults (not MLATransformerConfig's)
    assert (args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim, args.qk_pos_emb_head_dim) == (None, 32, 128, 64)
    assert (args.v_head_dim, args.rotary_scaling_factor, args.mscale, args.mscale_all_dim) == (128, 1.0, 1.0, 0.0)
    assert args.rope_type is None and args.quick_geglu is False
    for flag in ("--multi-latent-attention", "--mtp-num-layers", "--window-size", "--quick-geglu", "--q-lora-rank"):
        assert refusal_for(flag) is None or flag in {"--mtp-num-layers"}


def test_mla_builds_megatron_cores_mla_config_with_yarn_by_default():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_npu.training.config import transformer_config

    args = parse("--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--v-head-dim", "8")
    config = transformer_config(args)
    assert isinstance(config, MLATransformerConfig) and config.rope_type == "yarn"
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.v_head_dim) == (None, 16, 16, 8)
    assert config.rotary_scaling_factor == 1.0 and config.original_max_position_embeddings == 4096
    assert transformer_config(parse("--multi-latent-attention", "--rope-type", "rope")).rope_type == "rope"


def test_gpt_oss_activation_windows_sinks_and_uneven_stages_reach_the_config():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    from megatron_npu.training.config import transformer_config

    args = parse(
        "--quick-geglu",
        "--glu-linear-offset",
        "1.0",
        "--activation-func-clamp-value",
        "7.0",
        "--window-size",
        "128,0",
        "--window-attn-skip-freq",
        "2",
        "--softmax-type",
        "learnable",
        "--no-rope-freq",
        "[0,0,0,1]",
        "--pipeline-model-parallel-size",
        "2",
        "--decoder-first-pipeline-num-layers",
        "1",
        world_size=2,
    )
    config = transformer_config(args)
    assert config.activation_func is quick_gelu and config.gated_linear_unit and not config.bias_activation_fusion
    assert (config.glu_linear_offset, config.activation_func_clamp_value) == (1.0, 7.0)
    assert config.window_size == (128, 0) and config.window_attn_skip_freq == 2 and config.softmax_type == "learnable"
    assert config.no_rope_freq == [0, 0, 0, 1]
    assert config.num_layers_in_first_pipeline_stage == 1 and config.num_layers_in_last_pipeline_stage is None


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--rope-type", "yarn"], "--rope-type yarn needs --multi-latent-attention"),
        (["--multi-latent-attention", "--group-query-attention"], "mutually exclusive"),
        (["--quick-geglu", "--swiglu"], "mutually exclusive"),
        (["--mtp-num-layers", "1", "--position-embedding-type", "learned_absolute"], "rope or none"),
        (["--window-attn-skip-freq", "[1,0]"], "gives 2 layers; --num-layers is 4"),
        (
            ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "4"],
            "leaves 0 layers for 1 middle pipeline stages",
        ),
        (
            ["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "1", "--num-layers", "5"],
            "4 layers between the first and last stage are not divisible by the 3 middle stages",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|t|tL"],
            "has 3 stages, not a multiple of --pipeline-model-parallel-size 2",
        ),
    ],
)
def test_bad_family_flags_are_one_line_errors(flags, said):
    world = 4 if "4" in flags[1:2] else 2
    with pytest.raises(ConfigError, match=None) as error:
        parse(*flags, world_size=world)
    assert said in str(error.value), str(error.value)


def test_account_for_embedding_and_loss_count_in_the_even_split():
    parse(
        "--pipeline-model-parallel-size",
        "3",
        "--num-layers",
        "4",
        "--account-for-embedding-in-pipeline-split",
        "--account-for-loss-in-pipeline-split",
        world_size=3,
    )  # 4 + 2 over 3 stages
    with pytest.raises(ConfigError, match="not divisible"):
        parse(
            "--pipeline-model-parallel-size",
            "3",
            "--num-layers",
            "4",
            "--account-for-loss-in-pipeline-split",
            world_size=3,
        )


def test_standard_attention_yarn_reaches_gpt_models_yarn_embedding_and_the_attention_factor():
    """--position-embedding-type yarn with the YaRN flags (core_v0.16.1's --rotary-scaling-factor / --mscale /
    --mscale-all-dim, core_v0.19.0's --yarn-*) sets the config.yarn_* attributes megatron-core's GPTModel builds
    YarnRotaryEmbedding from; without the --yarn-* flags, YarnRotaryEmbedding's defaults (as core_v0.19.0)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    from megatron_npu.training.config import transformer_config

    published = parse(
        *("--position-embedding-type", "yarn", "--rotary-scaling-factor", "32", "--yarn-beta-fast", "16"),
        *("--yarn-original-max-position-embeddings", "4096", "--no-yarn-correction-range-round-to-int"),
    )
    config = transformer_config(published)
    assert (config.yarn_rotary_scaling_factor, config.yarn_original_max_position_embeddings) == (32.0, 4096)
    assert (config.yarn_beta_fast, config.yarn_beta_slow, config.yarn_mscale, config.yarn_mscale_all_dim) == (
        16.0,
        1.0,
        1.0,
        0.0,
    )
    assert config.yarn_correction_range_round_to_int is False and published.apply_rope_fusion is False
    assert _yarn_get_concentration_factor_from_config(config) == pytest.approx(1 + 0.1 * math.log(32))
    defaults = transformer_config(parse("--position-embedding-type", "yarn"))
    assert (defaults.yarn_original_max_position_embeddings, defaults.yarn_correction_range_round_to_int) == (4096, True)
    assert not hasattr(transformer_config(parse()), "yarn_rotary_scaling_factor")  # RoPE: no attention factor


def test_enable_gpt_oss_builds_what_megatron_lms_pretrain_gpt_builds():
    """Megatron-LM core_v0.16.1's pretrain_gpt.py parses --enable-gpt-oss and builds the same model (its fixed
    YaRN acts only in ModelOpt's builder): accepted with no effect, the reason printed; YaRN is asked for with
    --position-embedding-type yarn, whose wrong combinations are refused."""
    from megatron_npu.training.config import transformer_config

    args = parse("--enable-gpt-oss")
    assert args.position_embedding_type == parse().position_embedding_type  # as without it: no YaRN
    assert not hasattr(transformer_config(args), "yarn_rotary_scaling_factor")
    assert [flag for flag, _ in args.ignored_flags] == ["--enable-gpt-oss"]
    assert "--position-embedding-type yarn" in dict(args.ignored_flags)["--enable-gpt-oss"]
    for flags, said in (
        (["--position-embedding-type", "yarn", "--multi-latent-attention"], "--rope-type yarn"),
        (["--position-embedding-type", "yarn", "--rotary-interleaved"], "megatron-core's YaRN rotates halves"),
    ):
        with pytest.raises(ConfigError, match=None) as error:
            parse(*flags)
        assert said in str(error.value), str(error.value)
