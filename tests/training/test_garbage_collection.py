"""--manual-gc as Megatron-LM core_v0.16.1 runs it: Python's threshold collector off during training, a full
collection at the start, every --manual-gc-interval steps and before each evaluation, a young-generation one
after it (--no-manual-gc-eval: none around evaluations); without --manual-gc the collector is left alone."""

from __future__ import annotations

import gc

import pytest

from megatron_npu.training.garbage_collection import GarbageCollection
from megatron_npu.training.sections import TrainingSection


@pytest.fixture
def collections(monkeypatch):
    """The generation of every collection the trainer asks for (the automatic ones are not counted)."""
    seen: list[int] = []
    collect = gc.collect

    def recorded(generation: int = 2) -> int:
        seen.append(generation)
        return collect(generation)

    monkeypatch.setattr(gc, "collect", recorded)
    return seen


def _loop(collector: GarbageCollection, steps: int, evaluate_at: set[int]) -> list[bool]:
    """A training loop's calls, as trainer.py makes them; whether the automatic collector was on at each step."""
    enabled = []
    with collector:
        for iteration in range(1, steps + 1):
            enabled.append(gc.isenabled())
            if iteration in evaluate_at:
                collector.before_evaluation()
                collector.after_evaluation()
            collector.after_step(iteration)
    return enabled


def test_manual_collection_at_the_start_every_interval_and_around_evaluations(collections):
    collector = GarbageCollection(TrainingSection(manual_gc=True, manual_gc_interval=3))
    assert gc.isenabled()
    enabled = _loop(collector, steps=7, evaluate_at={4})
    assert enabled == [False] * 7
    # start (full), evaluation at 4 (full before, youngest after), steps 3 and 6
    assert collections == [2, 2, 2, 0, 2]
    assert gc.isenabled()  # given back to the process afterwards


def test_no_collection_around_evaluations_with_no_manual_gc_eval_and_none_between_steps_at_interval_0(
    collections,
):
    collector = GarbageCollection(TrainingSection(manual_gc=True, manual_gc_interval=0, manual_gc_eval=False))
    assert _loop(collector, steps=4, evaluate_at={2}) == [False] * 4
    assert collections == [2]  # the start only


def test_without_manual_gc_the_collector_is_left_alone(collections):
    collector = GarbageCollection(TrainingSection(manual_gc_interval=1))
    assert _loop(collector, steps=3, evaluate_at={1}) == [True] * 3
    assert collections == []


def test_the_flags_are_megatron_lms_and_fill_the_training_section():
    from megatron_npu.training.arguments import parse_args

    small = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "128"]
    run = ["--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data"]
    gc_flags = ["--manual-gc", "--manual-gc-interval", "10", "--no-manual-gc-eval"]
    args = parse_args([*small, *run, *gc_flags], world_size=1, check_paths=False)
    assert (args.training.manual_gc, args.training.manual_gc_interval, args.training.manual_gc_eval) == (
        True,
        10,
        False,
    )
