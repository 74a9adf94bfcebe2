"""megatron_npu/patches/adam_step.py: megatron-core's torch-Adam fallback with the state its own init_state_fn writes
(exp_avg, exp_avg_sq, no 'step'), on a 1-rank gloo world. Found by megatron-core's
dist_checkpointing/test_optimizer.py (KeyError: 'step', 64 tests). The save/reload cases (one 4-rank torchrun job,
~40-70 s) check the property megatron-core's test_optimizer_common_state_dict states, which its suite cannot reach
here (its model builder uses the TE spec)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import megatron_npu  # noqa: F401  (patches on import)


def _model(ddp: bool) -> torch.nn.Module:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)

    class Tiny(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            self.linear = torch.nn.Linear(4, 4)

    torch.manual_seed(0)
    module = Tiny()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=ddp)
    if ddp:
        return DistributedDataParallel(config, ddp_config, module)
    module.ddp_config = ddp_config  # what a DDP-wrapped chunk carries
    return module


def _optimizer(distributed: bool, bf16: bool = False) -> tuple[torch.nn.Module, object]:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = _model(distributed)
    config = OptimizerConfig(
        optimizer="adam", lr=0.1, weight_decay=0.0, bf16=bf16, use_distributed_optimizer=distributed
    )
    optimizer = get_megatron_optimizer(config, [model]).chained_optimizers[0]
    assert isinstance(optimizer.optimizer, torch.optim.AdamW)  # the torch fallback: no Apex / TE here
    optimizer.init_state_fn(optimizer.optimizer, config)  # megatron-core's own: no 'step'
    assert all("step" not in state for state in optimizer.optimizer.state.values())
    return model, optimizer


def test_distributed_optimizer_state_dict_reads_an_unstepped_state_as_step_0(model_parallel):
    """distrib_optimizer.py state_dict: KeyError 'step' (48 tests of dist_checkpointing/test_optimizer.py)."""
    _, optimizer = _optimizer(distributed=True)
    state = optimizer.state_dict()
    assert [group["step"] for group in state["optimizer"]["param_groups"]] == [0.0] * len(optimizer.param_groups)


def test_a_distributed_optimizer_shard_without_parameters_keeps_its_loaded_step(model_parallel):
    """distrib_optimizer.py state_dict asserts one step among the torch states; a DP shard that holds no parameter
    (a small model's padded tail) has none: AssertionError (dist_checkpointing/test_optimizer.py::
    test_optimizer_resharding[initialize_1d_flatten_tensor_model-...(2, 4) -> (2, 2), distributed optimizer])."""
    _, optimizer = _optimizer(distributed=True)
    for group in optimizer.optimizer.param_groups:  # what DistributedOptimizer builds for an empty shard
        group["params"] = []
    optimizer.optimizer.state.clear()
    state = optimizer.state_dict()
    assert [group["step"] for group in state["optimizer"]["param_groups"]] == [0.0] * len(optimizer.param_groups)
    assert "state_dict" not in vars(optimizer.optimizer)  # torch's own state_dict again
    for group in optimizer.optimizer.param_groups:
        group["step"] = 7.0  # what DistributedOptimizer.load_state_dict leaves in the groups from a checkpoint
    assert {group["step"] for group in optimizer.state_dict()["optimizer"]["param_groups"]} == {7.0}


@pytest.mark.parametrize("bf16", [True, False], ids=["float16_optimizer", "fp32_optimizer"])
def test_a_state_saved_before_the_first_step_loads_and_steps_as_a_fresh_one(model_parallel, bf16):
    """Float16OptimizerWithFloat16Params / FP32Optimizer.load_state_dict: torch Adam.__setstate__ KeyError
    'step' (16 tests); after the load the first step equals a fresh torch AdamW's first step."""
    model, optimizer = _optimizer(distributed=False, bf16=bf16)
    saved = copy.deepcopy(optimizer.state_dict())
    optimizer.load_state_dict(saved)
    assert all(float(state["step"]) == 0.0 for state in optimizer.optimizer.state.values())
    _steps_as_a_fresh_adamw(model, optimizer, bf16)


@pytest.mark.parametrize("bf16", [True, False], ids=["float16_optimizer", "fp32_optimizer"])
def test_the_first_step_over_init_state_fns_state_steps_as_a_fresh_one(model_parallel, bf16):
    """MixedPrecisionOptimizer / FP32Optimizer.step_with_ready_grads: torch Adam._init_group KeyError 'step'
    (dist_checkpointing/test_layer_wise_optimizer.py::test_layer_wise_optimizer_step)."""
    model, optimizer = _optimizer(distributed=False, bf16=bf16)
    _steps_as_a_fresh_adamw(model, optimizer, bf16)


def _steps_as_a_fresh_adamw(model: torch.nn.Module, optimizer: object, bf16: bool) -> None:
    params = list(model.parameters())
    reference = [p.detach().clone().float().requires_grad_() for p in params]
    fresh = torch.optim.AdamW(reference, lr=0.1, weight_decay=0.0)
    for param, ref in zip(params, reference, strict=True):
        grad = torch.full_like(ref, 0.5)
        ref.grad = grad
        param.main_grad = grad.to(param.dtype) if bf16 else grad
        param.grad = param.main_grad
    optimizer.config.use_distributed_optimizer = False
    assert optimizer.step()[0]
    fresh.step()
    for param, ref in zip(params, reference, strict=True):
        torch.testing.assert_close(param.detach().float(), ref.detach(), rtol=1e-2 if bf16 else 0, atol=0)


STEP_SYNCED_WORKER = Path(__file__).resolve().parents[1] / "fixtures" / "adam_step_synced_worker.py"


@pytest.fixture(scope="module")
def step_synced_round_trips() -> dict[int, dict]:
    from distributed import torchrun

    return torchrun(STEP_SYNCED_WORKER, nproc=4, timeout=600).check().by_rank()


@pytest.mark.launch
@pytest.mark.parametrize("case", ["distributed", "distributed_fully_parallel"])
def test_a_reloaded_distributed_optimizer_has_the_saved_step_in_every_group_on_every_rank(
    step_synced_round_trips, case
):
    """Mirrors megatron-core 0.16.1's dist_checkpointing/test_optimizer.py::TestDistributedOptimizer::
    test_optimizer_common_state_dict, its "check 'step' is synced" case (tp_pp_ep (1, 2, 1), fully_parallel False /
    True), which builds the TE spec and never reaches this patch here: PP 2 x DP 2 with the local spec, optimizer A
    holding init_state_fn's step-less states and a 'step' on every rank's param groups but rank 0's later ones; after
    a dist_checkpointing save and a load into a fresh optimizer B, B's state_dict equals A's on every rank, and every
    param group of every rank carries one step (torch's unstepped 0: KeyError 'step' without the patch)."""
    for rank, result in step_synced_round_trips.items():
        outcome = result[case]
        assert "error" not in outcome, (rank, outcome)
        assert outcome["diff"] == {"only_a": 0, "only_b": 0, "mismatch": 0, "first": "None"}, (rank, outcome)
        assert outcome["steps_a"] == outcome["steps_b"]
        every_group = {step for groups in outcome["steps_b_every_rank"] for step in groups}
        assert every_group == {0.0}, (rank, outcome["steps_b_every_rank"])


@pytest.mark.launch
def test_a_reloaded_mixed_precision_optimizer_state_dict_equals_the_saved_one(step_synced_round_trips):
    """Mirrors megatron-core 0.16.1's dist_checkpointing/test_layer_wise_optimizer.py::TestLayerWiseOptimizer::
    test_optimizer_common_state_dict for its Adam half (the Muon half needs emerging_optimizers): the non-distributed
    bf16 optimizer over torch Adam, saved and reloaded, has the same state_dict (its check_equal: the same keys
    too). Before, the reload's states had 'step' (completed on load, torch needs it) and the saved ones none."""
    for rank, result in step_synced_round_trips.items():
        outcome = result["float16"]
        assert "error" not in outcome, (rank, outcome)
        assert outcome["diff"] == {"only_a": 0, "only_b": 0, "mismatch": 0, "first": "None"}, (rank, outcome)
        assert outcome["state_steps_a"] == outcome["state_steps_b"] == [0.0], (rank, outcome)
