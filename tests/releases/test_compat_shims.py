"""megatron_npu.compat's shims, on the installed megatron-core (0.16.1) with stand-ins for the other releases'
APIs (the release matrix runs them on the real ones). No process is started."""

from __future__ import annotations

import argparse
import dataclasses
import functools

import pytest

from megatron_npu.compat import ReleaseGap, release_config
from megatron_npu.compat.core import call_with_vp_stage
from megatron_npu.compat.tokenizers import names_017


@dataclasses.dataclass
class OldConfig:  # a dataclass of an older release: it lacks the trainer's newer fields
    hidden_size: int = 8


def test_release_config_leaves_out_fields_an_older_release_lacks_when_they_ask_for_nothing():
    built = release_config(OldConfig, {"hidden_size": 16, "use_megatron_fsdp": False, "new_path": None})
    assert built == OldConfig(hidden_size=16)
    # the device SwiGLU seam (0.15+): the release runs the same activation unfused
    assert release_config(OldConfig, {"use_te_activation_func": True}) == OldConfig()


def test_release_config_refuses_a_feature_the_release_cannot_honour_in_one_line():
    with pytest.raises(ReleaseGap) as refused:
        release_config(OldConfig, {"use_megatron_fsdp": True})
    message = str(refused.value)
    assert "OldConfig.use_megatron_fsdp (set to True)" in message and "megatron-core 0." in message
    assert "\n" not in message


def test_vp_stage_is_passed_where_taken_left_out_without_virtual_stages_and_refused_with_them():
    def with_vp(config, vp_stage=None):
        return ("new", config, vp_stage)

    def without_vp(config):  # 0.12's signature
        return ("old", config)

    assert call_with_vp_stage(with_vp, 1, vp_stage=2) == ("new", 1, 2)
    assert call_with_vp_stage(without_vp, 1, vp_stage=None) == ("old", 1)
    with pytest.raises(ReleaseGap, match="num-layers-per-virtual-pipeline-stage"):
        call_with_vp_stage(without_vp, 1, vp_stage=0)


def test_tokenizer_arguments_get_0_17s_names_with_the_same_meaning():
    args = argparse.Namespace(
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_special_tokens=("<a>",),
        tokenizer_metadata="meta.json",
        tokenizer_hf_use_fast=True,
        tokenizer_hf_include_special_tokens=False,
    )
    renamed = names_017(args)
    assert renamed.special_tokens == ["<a>"] and renamed.metadata_path == "meta.json"
    assert renamed.tokenizer_hf_no_use_fast is False and renamed.tokenizer_hf_no_include_special_tokens is True
    assert renamed.pad_vocab_size is False and renamed.padded_vocab_size is None  # the trainer pads
    assert not hasattr(args, "special_tokens")  # a copy: the trainer's namespace is untouched


def test_the_mlp_submodules_of_a_spec_and_of_0_18s_builder_are_the_same_object():
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_npu.compat.specs import mlp_submodules

    submodules = MLPSubmodules()
    assert mlp_submodules(ModuleSpec(module=MLP, submodules=submodules)) is submodules
    assert mlp_submodules(functools.partial(MLP, submodules=submodules)) is submodules


def test_the_installed_release_keeps_its_own_apis():
    from megatron.core.models import backends
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    from megatron_npu.compat import core_tokenizer_builder, parallel_state
    from megatron_npu.compat.specs import LocalSpecProvider

    assert LocalSpecProvider is backends.LocalSpecProvider and core_tokenizer_builder() is build_tokenizer
    assert callable(parallel_state.get_tensor_model_parallel_world_size)  # megatron-core's, through the proxy


def test_a_release_without_the_checkpoint_format_refuses_save_and_load_at_start_up(monkeypatch, tmp_path):
    """0.12's dist_checkpointing.save takes no content metadata, 0.13-0.14 have no fully reshardable
    distributed-optimizer layout: said in one line before training, never at the first save."""
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_npu.policy import ConfigError
    from megatron_npu.training.arguments import parse_args

    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8"]
    base += ["--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3"]
    base += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]
    saving = ["--save", str(tmp_path), "--save-interval", "1"]
    parse_args([*base, *saving, "--use-distributed-optimizer"], world_size=1, check_paths=False)  # 0.16.1 has both

    monkeypatch.delattr(DistributedOptimizer, "checkpoint_fully_reshardable_formats")
    with pytest.raises(ConfigError, match=r"fully reshardable .* megatron-core 0\.\d+\.\d+: drop"):
        parse_args([*base, *saving, "--use-distributed-optimizer"], world_size=1, check_paths=False)
    parse_args([*base, *saving], world_size=1, check_paths=False)  # without it the format is complete

    monkeypatch.setattr(dist_checkpointing, "save", lambda sharded_state_dict, checkpoint_dir: None)
    with pytest.raises(ConfigError, match=r"content metadata .* drop --save / --load") as refused:
        parse_args([*base, "--load", str(tmp_path)], world_size=1, check_paths=False)
    assert "\n" not in str(refused.value)
    parse_args(base, world_size=1, check_paths=False)  # nothing saved or loaded: nothing asked


def test_a_release_without_vp_stage_refuses_virtual_pipeline_stages_at_start_up(monkeypatch):
    """0.12's parallel_state stage tests take no vp_stage: --num-layers-per-virtual-pipeline-stage is refused in
    one line by the argument checks (before any process group), not when the model is built."""
    from megatron.core import parallel_state

    from megatron_npu.policy import ConfigError
    from megatron_npu.training.arguments import parse_args

    base = ["--num-layers", "4", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8"]
    base += ["--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3"]
    base += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]
    layout = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    layout += ["--global-batch-size", "2"]
    parse_args([*base, *layout], world_size=2, check_paths=False)  # 0.16.1 takes vp_stage

    def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:  # 0.12's signature
        return True

    monkeypatch.setattr(parallel_state, "is_pipeline_first_stage", is_pipeline_first_stage)
    with pytest.raises(ConfigError, match=r"vp_stage\) is not in megatron-core 0\.\d+\.\d+: drop") as refused:
        parse_args([*base, *layout], world_size=2, check_paths=False)
    assert "\n" not in str(refused.value) and "megatron-core >= 0.13" in str(refused.value)
    parse_args([*base, "--pipeline-model-parallel-size", "2"], world_size=2, check_paths=False)  # no VPP: no ask


def test_a_release_without_mtp_on_this_rank_refuses_multi_token_prediction_at_start_up(monkeypatch):
    """0.12-0.15 lack megatron-core's mtp_on_this_rank (0.12 also the MTP block spec for a backend): --mtp-num-layers
    is refused in one line before any process group; pretrain_gpt.py itself still imports (the full matrix runs it)."""
    from megatron.core.transformer import multi_token_prediction

    from megatron_npu.policy import ConfigError
    from megatron_npu.training.arguments import parse_args

    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8"]
    base += ["--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3"]
    base += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]
    base += ["--position-embedding-type", "rope"]
    parse_args([*base, "--mtp-num-layers", "1"], world_size=1, check_paths=False)  # 0.16.1 has it

    monkeypatch.delattr(multi_token_prediction, "mtp_on_this_rank")
    with pytest.raises(ConfigError, match=r"mtp_on_this_rank\) is not in megatron-core 0\.\d+\.\d+: drop") as refused:
        parse_args([*base, "--mtp-num-layers", "1"], world_size=1, check_paths=False)
    assert "\n" not in str(refused.value) and "megatron-core >= 0.16" in str(refused.value)
    parse_args(base, world_size=1, check_paths=False)  # no MTP: nothing asked


def test_a_release_without_the_fully_reshardable_layout_has_no_reshardable_optimizer_formats(monkeypatch):
    """0.13-0.14: resuming this trainer's checkpoints (no distributed-optimizer state there) asks for the formats."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_npu.compat import fully_reshardable_optimizer_formats

    assert "fully_reshardable" in fully_reshardable_optimizer_formats()  # 0.16.1's
    monkeypatch.delattr(DistributedOptimizer, "checkpoint_fully_reshardable_formats")
    assert fully_reshardable_optimizer_formats() == ()
