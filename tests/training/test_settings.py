"""Settings are validated once and read-only after start-up; run counters live in RunState.

Every pretrain_gpt.py job in the suite runs with frozen settings (loop.setup_args freezes them
before any process group exists), so a write anywhere in the trainer fails those jobs; these
tests pin the contract itself."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_npu.layout.model_shape import ModelShape
from megatron_npu.layout.parallel_dims import ParallelDims
from megatron_npu.training.arguments import parse_args
from megatron_npu.training.run_state import RunState
from megatron_npu.training.settings import FrozenSettingsError, Settings

BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 16 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --lr 1e-3 --train-iters 4"
).split()


def settings(*flags: str, world_size: int = 8) -> Settings:
    return parse_args([*BASE, *flags], world_size=world_size, check_paths=False)


def test_parse_args_gives_settings_with_the_typed_layout_and_shape():
    args = settings("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    assert isinstance(args, Settings) and isinstance(args, argparse.Namespace)
    assert isinstance(args.parallel, ParallelDims) and isinstance(args.model_shape, ModelShape)
    assert (args.parallel.tp, args.parallel.pp, args.parallel.dp) == (2, 2, 2)
    assert args.data_parallel_size == args.parallel.dp  # Megatron-LM's name, one source
    assert args.parallel.microbatches(args.global_batch_size, args.micro_batch_size) == 4
    assert args.ffn_hidden_size == args.model_shape.ffn_hidden_size == 256


def test_frozen_settings_refuse_writes_and_deletes_naming_run_state():
    args = settings().freeze()
    with pytest.raises(FrozenSettingsError, match="read-only after start-up.*'iteration'.*RunState"):
        args.iteration = 3
    with pytest.raises(FrozenSettingsError):
        del args.lr
    assert args.lr == 1e-3


def test_values_are_the_flags_without_the_lock_or_typed_members():
    args = settings().freeze()
    values = args.values()
    assert values["num_layers"] == 4 and values["data_parallel_size"] == 8
    assert not {"_frozen", "parallel", "model_shape"} & set(values)
    copy = args.copy()
    copy.lr = 2.0  # a plain, writable namespace (what a Megatron-LM checkpoint's ``args`` is)
    assert args.lr == 1e-3 and "ParallelDims" not in repr(args)


def test_run_counters_are_not_settings():
    args = settings()
    for counter in ("iteration", "consumed_train_samples", "consumed_valid_samples"):
        assert not hasattr(args, counter), counter


def test_run_state_round_trips_its_counters_and_not_the_exit_reason():
    state = RunState(iteration=7, consumed_train_samples=56, exit_reason="at iteration 7")
    state.count_step(8, updated=False, finite=False)
    assert (state.consumed_train_samples, state.skipped_iterations, state.nan_iterations) == (64, 1, 1)
    restored = RunState()
    restored.load_state_dict(state.state_dict())
    assert restored == dataclasses.replace(state, exit_reason=None)


def test_run_state_loads_a_checkpoint_without_the_newer_counters():
    state = RunState()
    state.load_state_dict({"iteration": 3, "consumed_train_samples": 24})
    assert (state.iteration, state.consumed_train_samples, state.nan_iterations) == (3, 24, 0)


def test_interleaving_rules_live_in_the_layout():
    dims = ParallelDims(world_size=2, pp=2, vpp=2, num_layers=4)  # DP 1
    assert dims.check_global_batch(8, 1) == 8
    with pytest.raises(ValueError, match="must lie in \\[PP=2, M=1\\]"):
        dims.check_global_batch(1, 1)
    with pytest.raises(ValueError, match="remainder of 1"):
        dims.check_global_batch(5, 1, group_size=4)
