"""The settings sections: frozen, typed, a doc per field, and the parser generated from them."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_npu.policy import ConfigError
from megatron_npu.training import sections
from megatron_npu.training.arguments import build_parser, parse_args
from megatron_npu.training.sections.base import Section, argument_spec, field_docs, flag_fields
from megatron_npu.training.settings import SECTIONS

ARGV = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --train-iters 3 --lr 1e-3"
).split()

ALL_SECTIONS = [
    c for c in vars(sections).values() if isinstance(c, type) and issubclass(c, Section) and c is not Section
]


@pytest.fixture(scope="module")
def settings():
    return parse_args([*ARGV, "--swiglu", "--group-query-attention", "--num-query-groups", "2"], world_size=1)


def _actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    found: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        found.setdefault(action.dest, []).append(action)
    return found


def test_every_settings_member_is_a_section():
    assert {type(getattr(parse_args(ARGV, world_size=1), name)) for name in SECTIONS} <= set(ALL_SECTIONS)
    assert ALL_SECTIONS, "no sections found"


@pytest.mark.parametrize("section", ALL_SECTIONS, ids=lambda c: c.__name__)
def test_every_field_has_a_doc(section):
    docs = field_docs(section)
    missing = [f.name for f in dataclasses.fields(section) if not docs.get(f.name, "").strip()]
    assert missing == []


@pytest.mark.parametrize("section", ALL_SECTIONS, ids=lambda c: c.__name__)
def test_the_parser_takes_each_field_as_its_generated_flag(section):
    """Each field is one argument of the parser: its flags, its dest, its default, its doc as help."""
    by_dest = _actions_by_dest(build_parser())
    for field in flag_fields(section):
        flags, kwargs = argument_spec(section, field)
        [action] = [a for a in by_dest[field.name] if a.option_strings == flags]
        default = list(field.default) if isinstance(field.default, tuple) else field.default
        assert action.default == default, field.name
        assert field_docs(section)[field.name].replace("%", "%%") in action.help, field.name


def test_sections_are_frozen_and_hold_the_validated_values(settings):
    model = settings.model
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.num_layers = 3  # type: ignore[misc]
    # validation's derived values: SwiGLU's ffn, the kv channels, the query groups, the positions
    assert (model.ffn_hidden_size, model.kv_channels, model.num_query_groups) == (
        settings.ffn_hidden_size,
        16,
        2,
    )
    assert model.max_position_embeddings == 32
    assert "model" not in settings.values(), "sections are not flags (args.json, a checkpoint's args)"


def test_a_section_from_a_mapping_takes_its_fields_and_turns_lists_into_tuples(settings):
    values = dict(settings.values(), recompute_modules=None)
    model = sections.ModelSection.from_values(values)
    assert model == settings.model
    assert model.replace(num_layers=4).num_layers == 4 and model.num_layers == 2


def test_a_model_section_built_by_hand_checks_what_the_trainer_checks():
    with pytest.raises(ConfigError, match="--hidden-size is required"):
        sections.ModelSection(num_layers=2, num_attention_heads=4)
    with pytest.raises(ConfigError, match="--num-layers must be positive, got 0"):
        sections.ModelSection(num_layers=0, hidden_size=64, num_attention_heads=4)


def test_a_mutable_default_is_refused():
    with pytest.raises(TypeError, match="immutable"):
        sections.base.spec([1])


def test_components_are_built_from_their_sections_alone():
    """The validator, the step-schedule and the iteration count from a ScheduleSection and a layout, no namespace."""
    from megatron_npu.layout.parallel_dims import ParallelDims
    from megatron_npu.training.evaluation import Validator
    from megatron_npu.training.run_state import RunState

    schedule = sections.ScheduleSection(
        micro_batch_size=2, global_batch_size=16, train_iters=10, eval_interval=4, eval_iters=2
    )
    validator = Validator(schedule, ParallelDims(world_size=4, tp=2), RunState(), step=None)  # type: ignore[arg-type]
    assert validator.num_microbatches == 4  # 16 / (2 x DP 2)
    assert [i for i in range(1, 11) if validator.due(i)] == [4, 8]
    stepped = schedule.replace(step_batch_size_schedule=((0, 8), (3, 16)))
    assert [stepped.global_batch_size_at(i) for i in range(1, 6)] == [8, 8, 8, 16, 16]
    assert schedule.total_iterations() == 10
    # --train-samples with a ramp-up (8 samples per increment): 4, 4, 8, 12, 16, 16, 16 as megatron-core counts them
    ramped = schedule.replace(train_iters=None, train_samples=72, rampup_batch_size=("4", "4", "24"))
    assert ramped.total_iterations() == 7


def test_the_exit_policy_is_built_from_the_schedule_section_alone():
    from megatron_npu.training.exit_policy import ExitPolicy

    with ExitPolicy(sections.ScheduleSection(exit_interval=2)) as policy:
        assert [policy.reason(i) for i in (1, 2)] == [None, "at iteration 2 (--exit-interval 2)"]


class _Optimizer:
    """The two things the metrics read of megatron-core's optimizer: its groups' lr and its loss scale."""

    def __init__(self, lr: float) -> None:
        import torch

        self.param_groups = [{"params": [torch.zeros(1)], "lr": lr}]

    def get_loss_scale(self):
        import torch

        return torch.tensor(1.0)


def test_checkpointer_metrics_and_writer_are_built_from_their_sections_alone(tmp_path, model_parallel, capsys):
    """The checkpointer from a CheckpointSection, the metrics writer from a LoggingSection, the step
    metrics from the logging and model sections and a layout: saves due, unfinished saves removed,
    Megatron-LM's FLOPs formula, the iteration line averaged over --log-interval, metrics.jsonl."""
    import json

    import torch

    from megatron_npu.layout.parallel_dims import ParallelDims
    from megatron_npu.training.checkpoint_format import CheckpointedRun
    from megatron_npu.training.checkpointer import Checkpointer
    from megatron_npu.training.metrics import TrainingMetrics
    from megatron_npu.training.reporting import MetricsWriter, ModelFlops
    from megatron_npu.training.run_state import RunState
    from megatron_npu.training.step import StepResult
    from megatron_npu.training.timing import build_timers

    state, root = RunState(), tmp_path / "ckpt"
    checkpoint = sections.CheckpointSection(save=str(root), save_interval=3)
    run = CheckpointedRun(model_shape={}, distributed_optimizer=False, rng_per_dp_rank=False)  # read by saves, loads

    def checkpointer(section: sections.CheckpointSection) -> Checkpointer:
        return Checkpointer(section, run, state, [], None, None, None, overlap_param_gather=False, args_record={})

    saving = checkpointer(checkpoint)
    assert [i for i in range(1, 8) if saving.due(i)] == [3, 6] and saving.async_queue is None
    assert not any(checkpointer(checkpoint.replace(save=None)).due(i) for i in range(1, 8))
    (root / "iter_0000003.partial").mkdir(parents=True)
    saving.clean_unfinished()
    assert not (root / "iter_0000003.partial").exists()

    logging = sections.LoggingSection(log_dir=str(tmp_path / "logs"), log_interval=2, log_throughput=True)
    silent = MetricsWriter(logging.replace(log_dir=str(tmp_path / "other")), is_last_rank=False)
    silent.evaluation(2, 16, {"lm loss": 1.0}, "validation")
    assert not (tmp_path / "other").exists(), "only the last rank writes metrics"

    model = sections.ModelSection(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, kv_channels=16, num_query_groups=4
    )
    flops = ModelFlops(model, seq_length=32, padded_vocab_size=128)
    # Megatron-LM's num_floating_point_operations by hand: 12 B s l h^2 ((1 + g/a + s/h) kv a/h + ffn/h + V/2lh)
    expected = 12 * 8 * 32 * 2 * 64**2 * ((1 + 1 + 0.5) * 1 + 4 + 0.5)
    assert flops.per_iteration(8) == expected
    metrics = TrainingMetrics(
        logging,
        model,
        ParallelDims(world_size=1),
        state,
        _Optimizer(1e-3),
        build_timers(0),
        4,
        writer=MetricsWriter(logging, is_last_rank=True),
        flops=flops,
        params_dtype=torch.float32,
        moe=None,
    )
    capsys.readouterr()
    for loss in (2.0, 4.0):
        state.iteration += 1
        record = metrics.account(StepResult({"lm loss": torch.tensor(loss)}, True, 1.5, None, 4), 8, 0.5)
        metrics.write(record)
    metrics.close()
    assert record.throughput_tflops == expected / 0.5e12 and state.floating_point_operations_so_far == 2 * expected
    [line] = capsys.readouterr().out.splitlines()  # one iteration line per --log-interval 2
    assert "iteration        2/       4 | consumed samples:           16 |" in line
    assert "lm loss: 3.000000E+00 |" in line and "grad norm: 1.500 |" in line
    jsonl = [json.loads(text) for text in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["iteration"], m["consumed_samples"], m["lm_loss"], m["learning_rate"]) for m in jsonl] == [
        (1, 8, 2.0, 1e-3),
        (2, 16, 4.0, 1e-3),
    ]


def test_every_flag_is_declared_once_a_section_field_or_a_no_effect_row():
    """No hand-written argument: each dest of the parser is one section's field, or a row of the
    policy's no-effect table; the settings hold every section but the replaced flags'."""
    from megatron_npu.policy import NO_EFFECT_ARGS
    from megatron_npu.training.arguments import PARSER_GROUPS
    from megatron_npu.training.settings import SECTION_TYPES

    owners: dict[str, list[str]] = {}
    for section, _ in PARSER_GROUPS:
        for field in flag_fields(section):
            owners.setdefault(field.name, []).append(section.__name__)
    assert {name: found for name, found in owners.items() if len(found) > 1} == {}
    no_effect = {"no_effect_" + row.flag.lstrip("-").replace("-", "_") for row in NO_EFFECT_ARGS}
    dests = {a.dest for a in build_parser()._actions if a.option_strings and a.dest != "help"}
    assert dests == set(owners) | no_effect
    assert set(SECTION_TYPES.values()) == {s for s, _ in PARSER_GROUPS} - {sections.ReplacedFlags}


def test_the_moe_fsdp_and_distributed_sections_hold_the_validated_values():
    moe = parse_args(
        [*ARGV, "--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"]
        + ["--moe-aux-loss-coeff", "1e-2", "1e-3", "--moe-layer-freq", "[1,0]"],
        world_size=1,
    )
    assert moe.moe.num_experts == 4 and moe.moe.moe_layer_freq == (1, 0)
    assert moe.moe.moe_router_load_balancing_type == ("aux_loss", "seq_aux_loss")
    assert moe.moe.moe_aux_loss_coeff == (1e-2, 1e-3)
    dense = parse_args(ARGV, world_size=1)
    assert dense.moe.moe_router_load_balancing_type == "aux_loss"  # Megatron-LM collapses a list of one
    assert not dense.fsdp.enabled and dense.distributed.expert_tensor_parallel_size == 1  # expert TP = TP
    assert dense.training.apply_rope_fusion is dense.apply_rope_fusion
    rope = [build_parser().parse_known_args(flags)[0].apply_rope_fusion for flags in ([], ["--no-rope-fusion"])]
    legacy = build_parser().parse_known_args(["--no-rope-fusion", "--apply-rope-fusion"])[0].apply_rope_fusion
    assert (rope, legacy) == ([True, False], True)  # --apply-rope-fusion: the legacy spelling of the default
    assert dense.tokenizer.tokenizer_type == "NullTokenizer" and dense.init.seed == 1234


def test_preprocessing_takes_the_tokenizer_sections_flags():
    """tools' preprocess parser and the trainer's: one tokenizer group, the section's, with the same flags, dests,
    defaults, types and choices; and preprocessing reads its options back as that section."""
    from megatron_npu.data.preprocess import _options
    from megatron_npu.data.preprocess import build_parser as preprocess_parser

    def tokenizer_flags(parser: argparse.ArgumentParser) -> dict:
        (group,) = [g for g in parser._action_groups if g.title == "tokenizer"]
        return {
            tuple(a.option_strings): (a.dest, repr(a.default), a.type, a.nargs, a.choices, type(a).__name__)
            for a in group._group_actions
        }

    section = {tuple(argument_spec(sections.TokenizerSection, f)[0]) for f in flag_fields(sections.TokenizerSection)}
    preprocess, trainer = tokenizer_flags(preprocess_parser()), tokenizer_flags(build_parser())
    assert preprocess == trainer and set(preprocess) == section
    argv = ["--input", "x", "--output-prefix", "y", "--tokenizer-type", "NullTokenizer", "--vocab-size", "7"]
    argv += ["--tiktoken-special-tokens", "<a>", "<b>", "--vocab-extra-ids", "3"]
    options = _options(preprocess_parser().parse_args(argv))
    assert isinstance(options, sections.TokenizerSection) and options.tiktoken_special_tokens == ("<a>", "<b>")
    assert (options.vocab_size, options.vocab_extra_ids) == (7, 0)  # Megatron-LM's tool: no extra ids


def test_a_flag_that_is_a_field_carries_its_fate_and_the_policy_keeps_only_the_others():
    from megatron_npu import policy
    from megatron_npu.training.sections import ALL_SECTIONS, field_fates

    field_flags = set()
    for section in ALL_SECTIONS:
        for field in flag_fields(section):
            flags, _ = argument_spec(section, field)
            opposite = field.metadata.get("opposite")
            field_flags |= set(flags) | ({opposite[0]} if opposite else set())
            for row in field_fates(section).get(field.name, ()):
                assert row.flag in flags or (opposite and row.flag == opposite[0]), (field.name, row.flag)
    own = [row.flag for row in policy._NOT_FIELDS if not row.is_pattern and row.accepted is None]
    assert [flag for flag in own if flag in field_flags] == [], "a field's fate belongs on the field"
    assert {row.flag for row in policy.FLAG_POLICY} >= {"--transformer-impl", "--use-mcore-models", "--fp8-format"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--transformer-impl", "transformer_engine"],
            "--transformer-impl transformer_engine is not supported: Transformer Engine is CUDA-only; use "
            "--transformer-impl local (the default; `megatron-npu migrate` rewrites it)",
        ),
        (
            ["--use-tp-pp-dp-mapping"],
            "--use-tp-pp-dp-mapping is not supported: rank maps, rank tables and checks assume megatron-core's "
            "default order; drop it (the order is tp-cp-ep-dp-pp)",
        ),
    ],
)
def test_a_refused_field_is_refused_after_parsing_in_the_policys_words(flags, message):
    with pytest.raises(ConfigError) as error:
        parse_args([*ARGV, *flags], world_size=1)
    assert str(error.value) == message
