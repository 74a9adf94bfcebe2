"""The common part of a checkpoint (megatron_npu/training/checkpoint_format.py): Megatron-LM's fields
written from the settings and the run state, and a checkpoint of either trainer read back. The runs
across the two trainers: tests/upstream/test_checkpoint_interop.py."""

from __future__ import annotations

import argparse
import io

import megatron.core  # noqa: F401  (registers megatron-core's safe globals: Namespace, as Megatron-LM loads)
import pytest
import torch

from megatron_npu.training import sections
from megatron_npu.training.checkpoint_format import (
    CHECKPOINT_VERSION,
    MODEL_SHAPE_ARGS,
    CheckpointedRun,
    SavedRun,
    content_metadata,
    megatron_args,
    megatron_rng,
)
from megatron_npu.training.run_state import RunState
from megatron_npu.training.settings import Settings

LAYOUT = {"tp": 2, "pp": 2, "vpp": None, "dp": 2}


def _settings() -> Settings:
    settings = Settings(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=4,
        group_query_attention=False,
        params_dtype="float32",
        use_distributed_optimizer=True,
        data_parallel_random_init=False,
        seed=1234,
        tensor_model_parallel_size=2,
        lr_decay_samples=None,
        data_path=["1.0", "corpus"],
        rank=3,  # per process: the saved args are the same on every rank
        local_rank=1,
    )
    settings.parallel = object()  # a typed member: not a plain value, so not saved
    return settings.freeze()


def test_megatron_args_are_the_settings_and_the_counters_without_touching_the_settings() -> None:
    settings = _settings()
    before = dict(vars(settings))
    state = RunState(iteration=7, consumed_train_samples=56, consumed_valid_samples=16)
    args = megatron_args(settings.values(), state, LAYOUT, no_save_optim=False, no_save_rng=True)
    assert vars(settings) == before  # frozen: a write would have raised
    assert type(args) is argparse.Namespace and args is not settings
    assert (args.consumed_train_samples, args.consumed_valid_samples, args.iteration) == (56, 16, 7)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == (2, 2, 2)
    assert (args.world_size, args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (8, 1, 2)
    assert (args.no_save_optim, args.no_save_rng, args.ckpt_format) == (False, True, "torch_dist")
    assert args.params_dtype is torch.float32 and args.seed == 1234 and args.data_path == ["1.0", "corpus"]
    assert not any(hasattr(args, name) for name in ("parallel", "_frozen", "rank", "local_rank"))
    # Megatron-LM's loader reads common.pt with torch.load's default weights_only=True
    buffer = io.BytesIO()
    torch.save({"args": args}, buffer)
    buffer.seek(0)
    assert vars(torch.load(buffer)["args"]) == vars(args)


def test_the_run_a_checkpoint_records_is_read_from_the_sections() -> None:
    model = sections.ModelSection(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, kv_channels=16, num_query_groups=2
    )
    run = CheckpointedRun.from_sections(
        model,
        sections.DistributedSection(use_distributed_optimizer=True),
        sections.InitSection(data_parallel_random_init=True),
        sections.FsdpSection(),
        padded_vocab_size=384,
    )
    assert list(run.model_shape) == list(MODEL_SHAPE_ARGS)  # common.pt's model_shape keeps its key order
    assert run.model_shape["padded_vocab_size"] == 384 and run.model_shape["num_query_groups"] == 2
    assert run.model_shape["normalization"] == model.normalization and run.model_shape["swiglu"] is model.swiglu
    assert (run.distributed_optimizer, run.rng_per_dp_rank, run.torch_fsdp2) == (True, True, False)


def test_a_megatron_lm_checkpoint_reads_as_its_layout_counters_and_formats() -> None:
    args = argparse.Namespace(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        data_parallel_size=1,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=1,
        consumed_train_samples=24,
        consumed_valid_samples=8,
        no_save_optim=False,
        no_save_rng=False,
        use_distributed_optimizer=True,
        num_layers=4,
        num_attention_heads=4,
        num_query_groups=1,  # Megatron-LM's default, unused without --group-query-attention
        group_query_attention=False,
    )
    common = {"args": args, "iteration": 3, "checkpoint_version": 3.0, "num_floating_point_operations_so_far": 5.0}
    saved = SavedRun.read(common, {"distrib_optim_sharding_type": "dp_reshardable"})
    assert saved.written_by == "Megatron-LM"
    assert saved.layout == {"tp": 1, "pp": 1, "vpp": None, "dp": 1}
    assert saved.run_state == {
        "iteration": 3,
        "consumed_train_samples": 24,
        "consumed_valid_samples": 8,
        "floating_point_operations_so_far": 5.0,
    }
    assert saved.model_shape == {"num_layers": 4, "num_attention_heads": 4, "num_query_groups": 4}
    assert (saved.has_optimizer, saved.has_rng, saved.distributed_optimizer) == (True, True, True)
    assert saved.optimizer_sharding == "dp_reshardable" and not saved.rng_by_dp
    assert saved.loading_metadata()["distrib_optim_sharding_type"] == "dp_reshardable"
    # before content metadata (megatron-core < 0.13) Megatron-LM's optimizer was not reshardable
    assert SavedRun.read(common, None).optimizer_sharding == "dp_zero_gather_scatter"
    args.expert_model_parallel_size = 2  # under EP > 1 Megatron-LM shards the RNG states by DP rank too
    assert SavedRun.read(common, None).rng_by_dp and SavedRun.read(common, None).layout["ep"] == 2


def test_this_trainers_checkpoints_read_back_new_and_old() -> None:
    state = RunState(iteration=6, consumed_train_samples=48, skipped_iterations=1)
    args = megatron_args(_settings().values(), state, LAYOUT, no_save_optim=False, no_save_rng=False)
    common = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 6,
        "run_state": state.state_dict(),
        "layout": LAYOUT,
        "has_optimizer": True,
        "distributed_optimizer": True,
        "has_rng": True,
    }
    saved = SavedRun.read(common, content_metadata(True))
    assert saved.written_by == "megatron-npu" and saved.run_state == state.state_dict()
    assert saved.layout == LAYOUT and saved.optimizer_sharding == "fully_reshardable"
    assert saved.loading_metadata() == content_metadata(True)
    # saved before Megatron-LM's fields: top-level counters, no content metadata (always fully reshardable)
    old = {"iteration": 6, "consumed_train_samples": 48, "consumed_valid_samples": 0, "layout": LAYOUT}
    saved = SavedRun.read(old | {"has_optimizer": True, "distributed_optimizer": True, "has_rng": True}, None)
    assert saved.written_by.startswith("megatron-npu (before")
    assert saved.run_state == {"iteration": 6, "consumed_train_samples": 48, "consumed_valid_samples": 0}
    assert saved.optimizer_sharding == "fully_reshardable" and not saved.rng_by_dp
    with pytest.raises(ValueError, match="neither"):
        SavedRun.read({"iteration": 1}, None)


def test_rng_entries_take_megatron_lms_keys_whichever_trainer_saved_them() -> None:
    short = {"random": 1, "numpy": 2, "torch": 3, "device": 4, "tracker": 5}
    long = megatron_rng(short)
    assert long == {
        "random_rng_state": 1,
        "np_rng_state": 2,
        "torch_rng_state": 3,
        "cuda_rng_state": 4,
        "rng_tracker_states": 5,
    }
    assert megatron_rng(long) == long


def test_a_checkpoint_of_another_model_is_one_message_naming_each_differing_flag() -> None:
    from megatron_npu.training.arguments import ConfigError
    from megatron_npu.training.checkpointing import _check_model_shape

    saved = {"num_layers": 4, "hidden_size": 64, "padded_vocab_size": 128}
    _check_model_shape(saved, saved | {"swiglu": True}, "ckpt")  # what the checkpoint does not record: not compared
    with pytest.raises(ConfigError, match=r"--num-layers 4 \(given: 2\), --padded-vocab-size 128 \(given: 256\)$"):
        _check_model_shape(saved, {"num_layers": 2, "hidden_size": 64, "padded_vocab_size": 256}, "ckpt")
