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
