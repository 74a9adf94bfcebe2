"""megatron_npu/layout/fsdp_comm.py: FSDP's per-unit collectives and per-rank state (no torch)."""

import pytest

from megatron_npu.layout.fsdp_comm import megatron_fsdp_unit, padded, state_bytes_per_rank, torch_fsdp2_unit, totals


def test_optim_grads_params_gathers_twice_and_scatters_once_per_microbatch():
    items = megatron_fsdp_unit("layer0", numel=1001, dp=4, microbatches=3, strategy="optim_grads_params")
    by = {(i.op, i.phase): i for i in items}
    assert padded(1001, 4) == 1004
    # the first micro-batch's forward uses the post-step gather's weights (counted on megatron-core 0.16.1)
    assert by[("all_gather", "forward")].count == 2 and by[("all_gather", "backward")].count == 3
    assert (
        by[("all_gather", "forward")].payload_bytes == 251 * 4
        and by[("all_gather", "forward")].wire_bytes == 3 * 251 * 4
    )
    assert by[("reduce_scatter", "backward")].payload_bytes == 1004 * 4
    assert by[("reduce_scatter", "backward")].wire_bytes == 3 * 1004 * 4 // 4
    assert totals(items)["calls"] == 2 + 3 + 3 + 1  # fwd + bwd gathers, scatters, the post-step gather


def test_strategies_differ_where_megatron_fsdp_does():
    def calls(strategy, **kw):
        return totals(megatron_fsdp_unit("u", 1000, 2, 4, strategy, **kw))["calls"]

    assert calls("no_shard") == 1 and calls("optim") == 2 and calls("optim_grads") == 5
    assert calls("optim_grads_params") == 12 and calls("optim_grads_params", fsdp_unit=False) == 5
    assert megatron_fsdp_unit("u", 1000, 1, 4, "optim_grads_params") == []
    with pytest.raises(ValueError, match="optim_grads_params"):
        megatron_fsdp_unit("u", 1000, 2, 4, "zero3")


def test_fsdp2_regathers_every_unit_for_backward_unless_told_to_keep_it():
    # megatron-core passes reshard_after_forward to the root's fully_shard too: no root exception
    assert totals(torch_fsdp2_unit("any unit", 1000, 2, 2))["calls"] == 6
    assert totals(torch_fsdp2_unit("any unit", 1000, 2, 2, reshard_after_forward=False))["calls"] == 4
    assert torch_fsdp2_unit("any unit", 1000, 1, 2) == []


def test_state_falls_as_one_over_dp_when_everything_is_sharded():
    one = sum(state_bytes_per_rank(4096, 1, "optim_grads_params").values())
    four = sum(state_bytes_per_rank(4096, 4, "optim_grads_params").values())
    assert four * 4 == one
    ddp = state_bytes_per_rank(4096, 4, "ddp")
    assert ddp == {"params": 4096 * 4, "grads": 4096 * 4, "optimizer": 4096 * 8}
    assert state_bytes_per_rank(4096, 4, "optim_grads")["params"] == 4096 * 4
    assert state_bytes_per_rank(4096, 4, "dist_opt", param_bytes=2, grad_bytes=4)["optimizer"] == 1024 * 12
