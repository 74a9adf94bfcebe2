"""The planner's CP and FSDP rows, the memory model under FSDP and CP, and where TP x CP ranks sit
(no torch run: figures hand-computed for a 2-layer GPT, hidden 64, 4 heads of 16, fp32)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest

from megatron_npu.layout.memory import MemorySettings, predict
from megatron_npu.layout.parallel_dims import ParallelDims
from megatron_npu.layout.plan_cp_fsdp import cp_fsdp_fields, cp_subgroups, fsdp_units
from megatron_npu.layout.planner import ModelSpec, ParallelSpec, plan
from megatron_npu.layout.rankmap import build_rank_map, format_table
from megatron_npu.plan import cli as plan_cli

LAYER_NUMEL = 49984  # norms 2 x 128, qkv 64 x 192 + 192, proj 64 x 64 + 64, fc1 64 x 256 + 256, fc2 256 x 64 + 64


def model(global_batch_size: int = 4, **kw: object) -> ModelSpec:
    """seq 32, micro-batch 2: a CP2 rank holds 16 x 2 tokens."""
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2)
    return ModelSpec(**fields, global_batch_size=global_batch_size, vocab_size=128, params_dtype="fp32", **kw)


def groups_of(cp: int, tp: int = 1, nnodes: int = 1, nproc: int | None = None, **par: object) -> dict:
    world = tp * cp
    rmap = build_rank_map(tp=tp, cp=cp, nnodes=nnodes, nproc_per_node=nproc or world // nnodes)
    return plan(model(), rmap, ParallelSpec(**par)).ranks[0].by_label()


def test_ring_moves_kv_forward_and_kv_plus_fp32_dkv_backward_per_layer_and_microbatch():
    cp = groups_of(2)["cp"]  # DP1: 2 micro-batches
    kv = 32 * 4 * 16 * 4  # k (or v) of 32 tokens, 4 heads of 16, fp32
    shifts = 1 + 1 + 2  # K/V forward, K/V backward, dK/dV twice (P hops back to the owner)
    assert cp["bytes"] == 2 * 2 * shifts * 2 * (2 * kv)  # layers x micro-batches x shifts x (send + recv)
    assert cp["calls"] == 2 * 2 * shifts * 2
    assert cp["wire_intra"] == cp["bytes"] / 2 and cp["wire_inter"] == 0  # receives send nothing


def test_ulysses_all_to_alls_q_k_v_and_the_output_each_way():
    cp = groups_of(2, cp_comm_type="a2a")["cp"]
    tensor = 32 * 4 * 16 * 4  # q (and k, v, the output) of this rank, fp32
    assert cp["bytes"] == 2 * 2 * 2 * 4 * tensor  # layers x micro-batches x (fwd, bwd) x 4 tensors
    assert cp["calls"] == 2 * 2 * 2 * 4 and cp["wire_intra"] == cp["bytes"] / 2


def test_hierarchical_cp_counts_its_a2a_and_ring_levels_on_their_own_groups():
    assert cp_subgroups([0, 1, 2, 3], 2, "a2a+p2p", [2, 2]) == {"a2a": [2, 3], "ring": [0, 2]}
    assert cp_subgroups([0, 2, 4, 6], 4, "a2a+p2p", [2, 2]) == {"a2a": [4, 6], "ring": [0, 4]}
    g = groups_of(4, cp_comm_type="a2a+p2p", hierarchical_cp_sizes=[2, 2])
    assert "cp" not in g
    tensor = 16 * 4 * 16 * 4  # 8 tokens x 2 of a CP4 rank
    assert g["cp_a2a"]["bytes"] == 2 * 2 * 2 * 4 * tensor
    assert g["cp_ring"]["bytes"] == 2 * 2 * (1 + 1 + 2) * 2 * (2 * tensor)
    per_layer = groups_of(2, cp_comm_type=["p2p", "a2a"])["cp"]
    assert per_layer["bytes"] == (groups_of(2)["cp"]["bytes"] + groups_of(2, cp_comm_type="a2a")["cp"]["bytes"]) / 2


def test_tp_x_cp_across_nodes_is_inter_node_traffic_and_said_in_one_line():
    rmap = build_rank_map(tp=2, cp=2, nnodes=2, nproc_per_node=2)
    result = plan(model(), rmap, ParallelSpec())
    cp = result.ranks[0].by_label()["cp"]
    assert cp["wire_inter"] == cp["bytes"] / 2 and cp["wire_intra"] == 0
    note = "TP 2 x CP 2 = 4 ranks do not fit in a node of 2"
    assert note in result.table() and note in format_table(rmap)
    inside = build_rank_map(tp=2, cp=2, nnodes=2, nproc_per_node=4, world_size=8)
    assert "TP 2 x CP 2 blocks: each inside one node" in format_table(inside)


def test_megatron_fsdp_gathers_each_layer_three_times_and_scatters_once_instead_of_ddp_buckets():
    rmap = build_rank_map(world_size=4, nnodes=1, nproc_per_node=4)
    m = model(global_batch_size=8)  # DP4, one micro-batch
    dp_cp = plan(m, rmap, ParallelSpec(fsdp="optim_grads_params")).ranks[0].by_label()["dp_cp"]
    rest = 128 * 64 + 32 * 64 + 2 * 64  # embedding (vocab 128), positions (32), final norm; tied output
    shard, rest_shard = LAYER_NUMEL // 4 * 4, rest // 4 * 4
    # one micro-batch: the backward's and the post-step gathers of a shard (the forward uses the step's
    # weights), a full reduce-scatter
    layers = 2 * (2 * shard + 4 * shard)
    assert dp_cp["bytes"] == layers + rest_shard + 4 * rest_shard and dp_cp["calls"] == 2 * 3 + 2
    ddp = plan(m, rmap, ParallelSpec()).ranks[0].by_label()["dp_cp"]
    assert ddp["calls"] == 1 and ddp["bytes"] == (2 * LAYER_NUMEL + rest) * 4  # one bucket's all-reduce
    assert [
        u
        for u, _, _ in fsdp_units([("embedding.x", 1), ("decoder.layers.0.y", 2), ("output_layer.w", 3)], "torch_fsdp2")
    ] == [
        "embedding",
        "layer 0",
        "rest",
    ]


def test_megatron_fsdp_shards_experts_over_expert_data_parallel_as_counted():
    """EP2 on 4 ranks: dense weights over DP 4, each EP rank's 2 local experts a layer over expert DP 2, every
    layer's experts gathered just in time. Counted (CommCounter, pretrain_gpt.py 4 layers, untied, no bias, 4
    experts top-2, optim_grads_params, one micro-batch): 2,097,152 B on edp, as planned here."""
    rmap = build_rank_map(world_size=4, ep=2, nnodes=1, nproc_per_node=4)
    m = dataclasses.replace(model(global_batch_size=8), num_layers=4, num_experts=4, add_bias_linear=False)
    edp = plan(m, rmap, ParallelSpec(fsdp="optim_grads_params", use_distributed_optimizer=True)).ranks[0].by_label()
    experts = 2 * (64 * 256 + 256 * 64)  # a layer's local experts (fc1, fc2)
    # per layer: a full reduce-scatter, the post-step and the backward's gathers of a half
    assert edp["edp"]["bytes"] == 4 * (4 * experts + 2 * (experts // 2 * 4)) == 2_097_152
    assert edp["edp"]["calls"] == 4 * 3


def test_megatron_fsdp_makes_layers_units_only_when_it_shards_parameters_and_buckets_the_rest():
    params = [("embedding.w", 10), ("decoder.layers.0.a", 20), ("decoder.layers.1.a", 20), ("output_layer.w", 10)]
    assert fsdp_units(params, "optim_grads_params") == [
        ("rest", 20, False),
        ("layer 0", 20, True),
        ("layer 1", 20, True),
    ]
    # no FSDP unit modules below optim_grads_params: one bucket for the chunk (one call of each kind)
    assert fsdp_units(params, "optim_grads") == [("rest", 60, False)]
    # --ddp-bucket-size cuts the bucket after the parameter that reaches it
    assert fsdp_units(params, "optim", bucket_size=30) == [("rest", 30, False), ("rest 1", 30, False)]


def test_memory_model_shards_state_by_strategy_and_cp_shrinks_activations():
    m = model(global_batch_size=8)
    numel = 2 * LAYER_NUMEL + 128 * 64 + 32 * 64 + 2 * 64

    def state(dp: int, scheme: str | None) -> tuple[int, int, int]:
        r = predict(m, ParallelDims(world_size=dp), MemorySettings(fsdp_strategy=scheme), 0)
        return r.param_bytes, r.grad_bytes, r.optimizer_bytes

    shard = -(-numel // 4)
    assert state(4, "optim_grads_params") == (shard * 4, shard * 4, shard * 12)  # moments + fp32 main weights
    assert state(4, "optim") == (shard * 4 * 4, shard * 4 * 4, shard * 12)
    assert state(4, "torch_fsdp2") == (shard * 4, shard * 4, shard * 8)  # fp32: no main copy
    assert sum(state(4, "optim_grads_params")) == pytest.approx(sum(state(1, "optim_grads_params")) / 4, rel=1e-4)
    long = ModelSpec(2, 64, 4, 1024, 1, 1, 128, params_dtype="fp32")
    st = MemorySettings(attention_dropout=0, hidden_dropout=0)
    cp1, cp2 = (predict(long, ParallelDims(world_size=c, cp=c), st, 0) for c in (1, 2))
    tokens = 512
    assert cp2.saved_by_type["attention"] == 2 * (
        tokens * 64 * 4
        + 2 * tokens * 4  # LayerNorm: input, mean and rstd
        + tokens * 64 * 4  # qkv input
        + tokens * 4 * 64 * 4
        + 2 * 4 * tokens * 4  # CP attention: q, k, v, output (not the QKV output); fp32 row max and sum
        + tokens * 64 * 4  # projection input
    )
    assert cp2.saved_peak_bytes < 0.5 * cp1.saved_peak_bytes  # the s x s scores are gone as well


def test_plan_cli_reads_the_cp_and_fsdp_flags():
    fields = cp_fsdp_fields(
        {"cp_comm_type": ["a2a"], "use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim"}
    )
    assert fields == {"cp_comm_type": "a2a", "hierarchical_cp_sizes": None, "fsdp": "optim"}
    assert cp_fsdp_fields({"use_torch_fsdp2": True})["fsdp"] == "torch_fsdp2"
    shape = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32"
    argv = [*shape.split(), "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "128", "--json"]
    fsdp = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    fsdp += ["--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_cli.main(["--nnodes", "1", "--nproc-per-node", "4", *argv, *fsdp]) == 0
    result = json.loads(out.getvalue())
    assert result["parallel"]["fsdp"] == "optim_grads_params"
    assert any(i["what"].startswith("FSDP layer 0") for i in result["ranks"][0]["items"])
    assert (
        result["memory"][0]["param_bytes"]
        < 0.3 * predict(model(global_batch_size=8), ParallelDims(world_size=1), MemorySettings(), 0).param_bytes
    )
