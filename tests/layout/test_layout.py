"""Rank maps, the communication planner, the HCCL rank table and the 2x8 launch script (no torchrun)."""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import base_env

from megatron_npu.layout import planner, rankmap, ranktable
from megatron_npu.layout.model_shape import ModelShape, default_ffn_hidden_size, pad_vocab_size
from megatron_npu.layout.parallel_dims import TRAINER_FLAGS, ParallelDims
from megatron_npu.layout.planner import ModelSpec, ParallelSpec, plan
from megatron_npu.layout.rankmap import LayoutError, build_rank_map
from megatron_npu.layout.ranktable import RankTableError, build_rank_table, parse_nic_text
from megatron_npu.plan import cli as plan_cli

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "layout"
SCRIPT = REPO / "scripts" / "pretrain_gpt_8x2.sh"


# ---- rank map ---------------------------------------------------------------------------------
def naive_groups(world: int, tp: int, pp: int, cp: int) -> dict[str, list[list[int]]]:
    """Independent computation of megatron's tp-cp-dp-pp order: rank = tp + TP*(cp + CP*(dp + DP*pp))."""
    dp = world // (tp * pp * cp)
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    names = ["tp", "cp", "dp", "pp"]

    def rank(c: dict[str, int]) -> int:
        return c["tp"] + tp * (c["cp"] + cp * (c["dp"] + dp * c["pp"]))

    out: dict[str, list[list[int]]] = {}
    for varying in ("tp", "cp", "dp", "pp"):
        fixed = [n for n in names if n != varying]
        groups = []
        for combo in itertools.product(*(range(sizes[n]) for n in fixed)):
            c = dict(zip(fixed, combo, strict=True))
            groups.append(sorted(rank({**c, varying: i}) for i in range(sizes[varying])))
        out[varying] = sorted(groups)
    return out


LAYOUTS = [  # nnodes, nproc, tp, pp, cp
    (1, 8, 8, 1, 1),
    (2, 8, 8, 2, 1),
    (2, 8, 2, 2, 1),
    (1, 8, 2, 2, 1),
    (2, 8, 2, 2, 2),
    (4, 8, 4, 2, 2),
    (2, 4, 1, 2, 2),
    (2, 8, 1, 1, 1),
    (4, 8, 8, 4, 1),
    (2, 8, 4, 1, 4),
]


@pytest.mark.parametrize("nnodes,nproc,tp,pp,cp", LAYOUTS)
def test_groups_match_independent_computation(nnodes, nproc, tp, pp, cp):
    rmap = build_rank_map(tp=tp, pp=pp, cp=cp, nnodes=nnodes, nproc_per_node=nproc)
    expect = naive_groups(nnodes * nproc, tp, pp, cp)
    for name in ("tp", "cp", "dp", "pp"):
        assert sorted(sorted(g) for g in rmap.groups[name]) == expect[name], name
    for e in rmap.ranks:
        assert e.node == e.rank // nproc and e.local_rank == e.rank % nproc
        for name in ("tp", "pp", "dp", "cp"):
            group = next(g for g in rmap.groups[name] if e.rank in g)
            assert getattr(e, f"{name}_rank") == group.index(e.rank)
    assert not any(rmap.spans_nodes(g) for g in rmap.groups["tp"])
    assert rmap.dp == nnodes * nproc // (tp * pp * cp)


def test_known_layouts():
    m = build_rank_map(tp=8, pp=2, nnodes=2, nproc_per_node=8)
    assert m.groups["tp"] == [list(range(8)), list(range(8, 16))]
    assert m.groups["pp"] == [[i, i + 8] for i in range(8)]
    assert m.groups["dp"] == [[i] for i in range(16)]
    assert m.groups["embd"] == [[i, i + 8] for i in range(8)]
    assert rankmap.crossings(m)["pp_boundaries"] == [(i, i + 8) for i in range(8)]
    m = build_rank_map(8, tp=2, pp=2)  # one node of 8
    assert m.groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m.groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.groups["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    m = build_rank_map(tp=2, pp=1, cp=2, nnodes=1, nproc_per_node=8)
    assert m.groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m.groups["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(tp=16, nnodes=2, nproc_per_node=8), r"TP=16 would span nodes.*TP sizes that fit: 1, 2, 4, 8"),
        (dict(tp=3, nnodes=1, nproc_per_node=8), r"TP=3 would span nodes"),
        (
            dict(tp=8, pp=3, nnodes=2, nproc_per_node=8),
            r"world size 16 is not divisible by --tp 8 x --pp 3 x --cp 1 = 24",
        ),
        (dict(tp=2, pp=2, cp=3, nnodes=2, nproc_per_node=8), r"world size 16 is not divisible by .* = 12"),
        (dict(tp=2, pp=1, vpp=2, nnodes=1, nproc_per_node=8), r"--vpp \(interleaved schedule\) needs --pp > 1"),
        (
            dict(tp=2, pp=2, ep=3, nnodes=1, nproc_per_node=8),
            r"world size 8 is not divisible by --etp 2 x --ep 3 x --pp 2 = 12 \(the experts' grid\)",
        ),
        (dict(tp=0, nnodes=1, nproc_per_node=8), r"--tp must be >= 1"),
    ],
)
def test_bad_layouts_refused(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        ParallelDims.for_launch(**kwargs)
    with pytest.raises(LayoutError, match=message):
        build_rank_map(**kwargs)


def launch_sizes(dims: ParallelDims) -> tuple[int, int, int | None, int]:
    return dims.world_size, dims.nnodes, dims.nproc_per_node, dims.dp


def test_launch_layout_sizes_and_layers():
    assert launch_sizes(ParallelDims.for_launch(16, tp=8, pp=2, nnodes=2, nproc_per_node=8)) == (16, 2, 8, 1)
    assert launch_sizes(ParallelDims.for_launch(tp=2, nnodes=1, nproc_per_node=8, num_layers=4)) == (8, 1, 8, 4)
    with pytest.raises(LayoutError, match="--num-layers 5 is not divisible by --pp 2"):
        build_rank_map(tp=2, pp=2, nnodes=1, nproc_per_node=8, num_layers=5)


def test_rank_map_holds_the_layout_object_and_derives_the_rest():
    rmap = build_rank_map(tp=2, pp=2, nnodes=2, nproc_per_node=4, vpp=2)
    assert set(rankmap.RankMap.__dataclass_fields__) == {"dims", "ranks", "groups", "hosts"}  # no copied degree
    assert rmap.dims == ParallelDims.for_launch(tp=2, pp=2, nnodes=2, nproc_per_node=4, vpp=2)
    assert (rmap.world_size, rmap.tp, rmap.pp, rmap.dp, rmap.vpp) == (8, 2, 2, 2, 2)
    assert (rmap.nnodes, rmap.nproc_per_node) == (2, 4)


def run_files(rmap: rankmap.RankMap, nodes: list[int], **args: object) -> tuple[dict, dict]:
    """args.json and layout.json as the trainer writes them, with each rank on the node given."""
    layout = rmap.to_json()
    for entry, node in zip(layout["ranks"], nodes, strict=True):
        entry.update(node=node, host=f"host{node}")
    return dict(args), layout


def test_a_runs_layout_is_rebuilt_from_its_files():
    """perf-report's map: degrees from args.json, the node each rank really ran on from layout.json."""
    launched = build_rank_map(tp=2, pp=2, nnodes=2, nproc_per_node=4)
    trainer_args = dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        num_layers=8,
        num_layers_per_virtual_pipeline_stage=2,
        num_experts=None,
    )
    nodes = [0, 0, 1, 1, 0, 0, 1, 1]  # not torchrun's rank // 4: the rebuilt map must follow the record
    rmap = rankmap.rank_map_from_run(*run_files(launched, nodes, **trainer_args))
    assert rmap.dims == ParallelDims.from_args(trainer_args, 8) and rmap.vpp == 2
    assert rmap.groups == launched.groups  # the one derivation of every group
    assert [rmap.node_of(r) for r in range(8)] == nodes and rmap.nnodes == 2
    assert [e.host for e in rmap.ranks] == [f"host{n}" for n in nodes]
    assert rmap.spans_nodes([0, 2]) and not rmap.spans_nodes([0, 4])
    # files of two different runs, or a layout the trainer cannot have built, are refused by name
    wrong = {**trainer_args, "tensor_model_parallel_size": 4}
    with pytest.raises(LayoutError, match="layout.json's tp groups .* are not the ones args.json's layout builds"):
        rankmap.rank_map_from_run(*run_files(launched, nodes, **wrong))
    with pytest.raises(LayoutError, match="args.json: .*not divisible by --num-layers-per-virtual-pipeline-stage 3"):
        rankmap.rank_map_from_run(
            *run_files(launched, nodes, **{**trainer_args, "num_layers_per_virtual_pipeline_stage": 3})
        )
    with pytest.raises(LayoutError, match="layout.json lacks 'groups'"):
        rankmap.rank_map_from_run(trainer_args, {"world_size": 8, "ranks": run_files(launched, nodes)[1]["ranks"]})


# ---- the layout object: one rule, one message each --------------------------------------------
@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(world_size=0), r"^world size must be positive, got 0$"),
        (dict(world_size=8, pp=0), r"^--pp must be >= 1, got 0$"),
        (dict(world_size=8, cp=-1), r"^--cp must be >= 1, got -1$"),
        (dict(world_size=8, ep=0), r"^--ep must be >= 1, got 0$"),
        (
            dict(world_size=16, nproc_per_node=16, devices_per_node=8),
            r"^the launcher starts 16 processes per node but a node has 8 devices \(--devices-per-node\)$",
        ),
        (dict(world_size=8, tp=3, devices_per_node=8), r"^TP=3 does not fit in a node of 8 devices: .*\(--tp\)$"),
        (dict(world_size=16, tp=16, nnodes=2, nproc_per_node=8), r"^TP=16 would span nodes: .* 1, 2, 4, 8 \(--tp\)$"),
        (
            dict(world_size=12, tp=4, pp=2),
            r"^world size 12 is not divisible by --tp 4 x --pp 2 x --cp 1 = 8; "
            r"TP x PP x CP must be one of 1, 2, 3, 4, 6, 12$",
        ),
        (
            dict(world_size=8, tp=2, pp=2, ep=4),
            r"^world size 8 is not divisible by --etp 2 x --ep 4 x --pp 2 = 16 \(the experts' grid\); "
            r"EP sizes that fit: 1, 2$",
        ),
        (dict(world_size=8, ep=2, num_experts=0), r"^--ep 2 needs --num-experts \(a dense model has no experts\)$"),
        (
            dict(world_size=8, ep=4, num_experts=6),
            r"^--num-experts 6 is not divisible by --ep 4: every EP rank holds the same number of experts; "
            r"EP sizes that fit: 1, 2$",
        ),
        (dict(world_size=8, etp=0), r"^--etp must be >= 1, got 0$"),
        (dict(world_size=8, pp=2, vpp=0), r"^--vpp must be >= 1, got 0$"),
        (dict(world_size=8, vpp=2), r"^--vpp \(interleaved schedule\) needs --pp > 1$"),
        (dict(world_size=8, pp=4, num_layers=6), r"^--num-layers 6 is not divisible by --pp 4$"),
        (
            dict(world_size=8, pp=2, vpp=3, num_layers=8),
            r"^layers per pipeline stage \(8 / 2 = 4\) is not divisible by --vpp 3$",
        ),
    ],
)
def test_parallel_dims_rules(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        ParallelDims(**kwargs)


def test_parallel_dims_derived_sizes_and_trainer_flags():
    d = ParallelDims(32, tp=2, pp=2, cp=2, ep=2, vpp=2, nnodes=4, nproc_per_node=8, num_layers=8)
    assert (d.dp, d.dp_cp, d.model_parallel, d.virtual_stages, d.interleaved) == (4, 8, 4, 2, True)
    assert d.layers_per_chunk(8) == 2 and d.microbatches(64, 2) == 8
    assert ParallelDims.for_launch(tp=2, nnodes=2, nproc_per_node=4) == ParallelDims(
        8, tp=2, nnodes=2, nproc_per_node=4
    )
    assert ParallelDims.for_launch(8).nproc_per_node == 8  # one node holding every rank
    with pytest.raises(LayoutError, match="world_size 9 != --nnodes 2 x --nproc-per-node 4"):
        ParallelDims.for_launch(9, nnodes=2, nproc_per_node=4)
    with pytest.raises(
        LayoutError,
        match=r"^--global-batch-size 10 is not divisible by --micro-batch-size 2 x "
        r"data-parallel size 4 \(= world size 32 / \(TP 2 x PP 2 x CP 2\)\) = 8$",
    ):
        d.microbatches(10, 2)
    with pytest.raises(LayoutError, match=r"^--seq-length 127 is not divisible by 2 x --cp 2 = 4$"):
        d.check_seq_length(127, False)
    with pytest.raises(LayoutError, match=r"^--sequence-parallel needs --seq-length 6 divisible by --tp 4$"):
        ParallelDims(4, tp=4).check_seq_length(6, True)
    ParallelDims(4, tp=4).check_seq_length(6, False)  # without SP the sequence is not split over TP
    # the trainer's flags: the message names what pretrain_gpt.py was given
    args = dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        num_layers=8,
        num_layers_per_virtual_pipeline_stage=2,
    )
    assert ParallelDims.from_args(args, 4).vpp == 2
    assert ParallelDims.from_args({**args, "num_layers_per_virtual_pipeline_stage": 4}, 4).vpp is None  # 1 = none
    with pytest.raises(
        LayoutError,
        match=r"^layers per pipeline stage \(8 / 2 = 4\) is not divisible by "
        r"--num-layers-per-virtual-pipeline-stage 3$",
    ):
        ParallelDims.from_args({**args, "num_layers_per_virtual_pipeline_stage": 3}, 4)
    with pytest.raises(LayoutError, match="mutually exclusive"):
        ParallelDims.from_args({**args, "num_virtual_stages_per_pipeline_rank": 2}, 4)
    with pytest.raises(
        LayoutError,
        match=r"^world size 6 is not divisible by --tensor-model-parallel-size 2 x "
        r"--pipeline-model-parallel-size 2 x --context-parallel-size 1 = 4",
    ):
        ParallelDims.from_args(args, 6, TRAINER_FLAGS)


def test_model_shape_defaults_and_rules():
    assert default_ffn_hidden_size(64, False) == 256
    assert default_ffn_hidden_size(64, True) == 128  # int((256 * 2/3) / 64) * 64: Megatron-LM's SwiGLU rule
    assert default_ffn_hidden_size(4096, True) == 10880  # 10922.7 rounded down to 64
    s = ModelShape.build(4, 64, 4, swiglu=True, vocab_size=1000)
    assert (s.kv_channels, s.num_query_groups, s.ffn_hidden_size, s.fc1_out) == (16, 4, 128, 256)
    assert s.padded_vocab_size(1) == 1024 and s.padded_vocab_size(3) == 1152 and pad_vocab_size(128, 128, 2) == 256
    assert (
        ModelShape.from_args(
            {
                "num_layers": 4,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_query_groups": 2,
                "group_query_attention": False,
            }
        ).num_query_groups
        == 4
    )
    assert ModelShape.build(4, 64, 4, ffn_hidden_size=96, kv_channels=8).ffn_hidden_size == 96
    with pytest.raises(LayoutError, match=r"^--hidden-size 66 is not divisible by --num-attention-heads 4; "):
        ModelShape.build(4, 66, 4)
    with pytest.raises(LayoutError, match=r"^--num-attention-heads 4 is not divisible by --num-query-groups 3$"):
        ModelShape.build(4, 64, 4, num_query_groups=3)
    with pytest.raises(LayoutError, match=r"^--num-attention-heads 4 is not divisible by --tp 8$"):
        s.check_tensor_parallel(8)
    with pytest.raises(LayoutError, match=r"^--num-query-groups 2 is not divisible by --tp 4; "):
        ModelShape.build(4, 64, 8, num_query_groups=2).check_tensor_parallel(4)
    with pytest.raises(LayoutError, match=r"^--ffn-hidden-size 100 is not divisible by --tp 8$"):
        ModelShape.build(4, 64, 8, ffn_hidden_size=100).check_tensor_parallel(8)


def test_plan_swiglu_uses_the_trainers_ffn_default(capsys):
    """`megatron-npu plan --swiglu` without --ffn-hidden-size: fc1/fc2 sized by SwiGLU's 8h/3 rule, as trained."""
    args = [
        "--nnodes",
        "1",
        "--nproc-per-node",
        "1",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--vocab-size",
        "1000",
        "--dtype",
        "fp32",
        "--json",
    ]
    assert plan_cli.main([*args, "--swiglu"]) == 0
    swiglu = json.loads(capsys.readouterr().out)
    assert plan_cli.main([*args, "--swiglu", "--ffn-hidden-size", "128"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"] == swiglu["ranks"]
    assert swiglu["model"]["ffn_hidden_size"] == 128


def test_cli_json_table_and_refusal(capsys):
    assert rankmap.main(["--nnodes", "2", "--nproc-per-node", "8", "--tp", "8", "--pp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 16 and set(data["groups"]) == {"tp", "pp", "dp", "cp"}
    assert data["ranks"][9] == {
        "rank": 9,
        "node": 1,
        "local_rank": 1,
        "tp_rank": 1,
        "pp_rank": 1,
        "dp_rank": 0,
        "cp_rank": 0,
    }
    assert rankmap.main(["--nnodes", "2", "--nproc-per-node", "8", "--tp", "2", "--pp", "2", "--hosts", "a,b"]) == 0
    text = capsys.readouterr().out
    assert "node 0 (a)" in text and "node 1 (b)" in text
    assert "PP boundaries crossing nodes: 8" in text and "DP groups crossing nodes: 0 of 4" in text
    assert rankmap.main(["--nnodes", "2", "--nproc-per-node", "8", "--tp", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-npu rankmap: error: TP=16 would span nodes") and "Traceback" not in err


def test_cli_checks_the_layers_as_uneven_stages_and_layout_strings_split_them(capsys):
    """DeepSeek-V3's 61 layers: PP 2 splits them only with uneven end stages (what its recipe passes)."""
    base = ["--nnodes", "1", "--nproc-per-node", "8", "--tp", "4", "--pp", "2", "--num-layers", "61"]
    assert rankmap.main(base) == 2
    assert "61 is not divisible by --pp 2" in capsys.readouterr().err
    uneven = ["--decoder-first-pipeline-num-layers", "31", "--decoder-last-pipeline-num-layers", "30"]
    assert rankmap.main([*base, *uneven]) == 0
    assert "PP=2" in capsys.readouterr().out
    too_many = ["--decoder-first-pipeline-num-layers", "31", "--decoder-last-pipeline-num-layers", "31"]
    assert rankmap.main([*base, *too_many]) == 2
    assert "megatron-npu rankmap: error:" in capsys.readouterr().err
    assert rankmap.main([*base, "--pipeline-model-parallel-layout", "Et*30|t*31L"]) == 0


# ---- planner ----------------------------------------------------------------------------------
SMALL = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=128,
    micro_batch_size=2,
    global_batch_size=16,
    vocab_size=1000,
)
ACT = 128 * 2 * 64 * 2  # one [s, b, h] bf16 activation: 32768 bytes
LAYER = 128 + 2048 + 64 + 6144 + 96 + 128 + 8192 + 128 + 8192 + 64  # one layer's params at TP2: 25184
EMB = 1024 * 64 // 2  # padded vocab 1024 (multiple of 128*TP) / TP2 x hidden


def small_plan(**par) -> planner.CommPlan:
    rmap = build_rank_map(tp=2, pp=2, nnodes=2, nproc_per_node=4)  # dp=2; PP groups [i, i+4] cross nodes
    return plan(ModelSpec(**SMALL), rmap, ParallelSpec(**par))


def test_plan_small_model_hand_computed():
    p = small_plan()
    r0, r4 = p.ranks[0].by_label(), p.ranks[4].by_label()
    # 4 microbatches; 2 layers per stage; 4 all-reduces per layer + the embedding's forward one
    assert r0["tp"]["calls"] == 4 * 2 * 4 + 4 and r0["tp"]["bytes"] == 36 * ACT
    assert r0["tp"]["wire_intra"] == 36 * ACT and r0["tp"]["wire_inter"] == 0  # AR over 2: wire = N
    # last stage: output-layer dgrad all-reduce + 3 fp32 [s, b] cross-entropy all-reduces per microbatch
    assert r4["tp"]["calls"] == 32 + 4 + 12 and r4["tp"]["bytes"] == 36 * ACT + 12 * 128 * 2 * 4
    assert r0["pp"] == {"calls": 8, "bytes": 8 * ACT, "wire_intra": 0.0, "wire_inter": 4 * ACT}
    assert r0["dp_cp"]["calls"] == 1 and r0["dp_cp"]["bytes"] == (EMB + 128 * 64 + 2 * LAYER) * 4
    assert r0["dp_cp"]["wire_intra"] == r0["dp_cp"]["bytes"]  # DP pairs (0, 2) share node 0
    assert r4["dp_cp"]["bytes"] == (2 * LAYER + 128 + EMB) * 4
    assert r4["dp"] == {"calls": 1, "bytes": 8, "wire_intra": 8.0, "wire_inter": 0.0}  # loss report [sum, count]
    assert r0["embd"] == {"calls": 1, "bytes": EMB * 4, "wire_intra": 0.0, "wire_inter": EMB * 4}
    assert r0["mp"]["bytes"] == 4 and "dist_opt" not in r0
    assert p.ranks[1].by_label()["embd"] == r0["embd"]  # TP peer on the first stage: the same tied-embedding reduce
    assert (
        "embd" in r4
        and "embd"
        not in plan(ModelSpec(**SMALL, untie_embeddings_and_output_weights=True), p.layout).ranks[0].by_label()
    )
    seconds = p.time_s(0)
    intra = 36 * ACT + r0["dp_cp"]["bytes"]
    inter = 4 * ACT + EMB * 4 + 2 * 3 / 4 * 4
    assert seconds == pytest.approx(intra / (planner.HCCS_GBPS * 1e9) + inter / (planner.ROCE_GBPS * 1e9))


def test_plan_per_token_loss_shares_the_token_count():
    items = {(it.label, it.op, it.what) for it in small_plan(per_token_loss=True).ranks[0].items}
    assert {
        ("pp", "broadcast", "token count (per-token loss)"),
        ("dp_cp", "all_reduce", "token count (per-token loss)"),
    } <= items
    assert not any("token count" in it.what for it in small_plan().ranks[0].items)


def test_plan_sequence_parallel_and_distributed_optimizer():
    p = small_plan(sequence_parallel=True, use_distributed_optimizer=True)
    items = {(it.op, it.what): it for it in p.ranks[0].items}
    assert items[("all_gather", "layers: qkv/fc1 fwd + bwd recompute, proj/fc2 bwd")].bytes == 6 * 2 * 4 * ACT // 2
    assert items[("reduce_scatter", "layers: proj/fc2 fwd, qkv/fc1 dgrad")].bytes == 4 * 2 * 4 * ACT
    assert items[("all_reduce", "embedding fwd")].bytes == 4 * ACT  # learned positions: AR, then split
    assert items[("all_gather", "embedding bwd")].bytes == 4 * ACT // 2
    assert items[("all_reduce", "SP norm/bias grads")].bytes == 2 * (128 + 64 + 128 + 64) * 4
    assert p.ranks[0].by_label()["pp"]["bytes"] == 8 * ACT // 2  # [s/tp, b, h] with SP
    # distributed optimizer: the tied embedding gets its own bucket; buckets padded to lcm(dp, 128)
    rs = [it for it in p.ranks[0].items if it.label == "dp_cp" and it.op == "reduce_scatter"]
    ag = [it for it in p.ranks[0].items if it.label == "dp_cp" and it.op == "all_gather"]
    assert [it.payload for it in rs][-1] == EMB * 4 and len(rs) == 2
    assert [it.payload for it in ag] == [it.payload // 4 // 2 * 2 for it in rs]  # shard of dp=2, bf16
    assert "dist_opt" in p.ranks[0].by_label() and "mp" not in p.ranks[0].by_label()


def test_bucket_padding_rules():
    assert planner._buckets([("a", 100), ("b", 30)], 2, False, None, set()) == [130]
    assert planner._buckets([("a", 100), ("b", 30)], 2, True, None, set()) == [256]  # b@0, a@64..164 -> 256
    shared = {"embedding.word_embeddings.weight"}
    assert planner._buckets([("embedding.word_embeddings.weight", 100), ("x", 30)], 2, True, None, shared) == [128, 128]
    assert planner._buckets([("a", 50), ("b", 50), ("c", 50)], 1, False, 100, set()) == [100, 50]


def test_plan_refuses_and_cli(capsys):
    rmap = build_rank_map(tp=2, pp=2, nnodes=2, nproc_per_node=4)
    with pytest.raises(LayoutError, match="--global-batch-size 3"):
        plan(ModelSpec(**{**SMALL, "global_batch_size": 3}), rmap)
    args = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--tp",
        "2",
        "--pp",
        "2",
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "128",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "16",
        "--bf16",  # the trainer's flag: parameters in bf16 (fp32 without it)
        "--vocab-size",
        "1000",
    ]
    assert plan_cli.main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranks"][0]["groups"]["tp"]["bytes"] == 36 * ACT
    assert plan_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "ASSUMED bandwidths" in out and "rank 0 (node 0" in out and "rank 4 (node 1" in out
    assert plan_cli.main([*args[:-2], "--vocab-size", "1000", "--global-batch-size", "5"]) == 2
    assert "megatron-npu plan: error:" in capsys.readouterr().err


MEGATRON_CHECK = r"""
import json, sys, torch, torch.distributed as dist
import megatron_npu
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron_npu.layout.model_spec import ModelSpec, stage_params
from megatron_npu.layout.planner import _buckets
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
ps.initialize_model_parallel(1, 1)
model_parallel_cuda_manual_seed(1)
cases = [(False, "LayerNorm", True, "learned_absolute", True, True), (True, "RMSNorm", False, "rope", True, True),
         (False, "LayerNorm", True, "learned_absolute", True, False), (False, "LayerNorm", True, "learned_absolute", False, True)]
for swiglu, norm, tied, pos, pre, post in cases:
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                            gated_linear_unit=swiglu, normalization=norm, use_cpu_initialization=True, bf16=True,
                            params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization=norm), vocab_size=1024, max_sequence_length=128,
                     share_embeddings_and_output_weights=tied, position_embedding_type=pos,
                     pre_process=pre, post_process=post).bfloat16()
    real = [(n, p.numel()) for n, p in model.named_parameters()]
    spec = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128, micro_batch_size=1,
                     global_batch_size=1, vocab_size=1000, ffn_hidden_size=96, num_query_groups=2, swiglu=swiglu,
                     untie_embeddings_and_output_weights=not tied, normalization=norm, position_embedding_type=pos)
    mine = stage_params(spec, 1, 2, pre, post, 1)
    assert real == mine, (real, mine)
    for dist_opt in (False, True):
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt, overlap_grad_reduce=True, bucket_size=5000), model)
        got = [b.grad_data.numel() for buf in ddp.buffers for b in buf.buckets]
        assert got == _buckets(mine, 1, dist_opt, 5000, set()), (got, _buckets(mine, 1, dist_opt, 5000, set()))
# issue 35's architectures: QK norms, MLA with and without a q low rank, MTP on a last stage (its own
# embedding), dense-first MoE with shared experts and their gate
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from megatron.core.transformer import MLATransformerConfig
base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, use_cpu_initialization=True,
            normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True)
mla = dict(multi_latent_attention=True, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12)
moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48,
           moe_layer_freq=[0, 1], moe_shared_expert_gate=True)
spec_fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128, micro_batch_size=1,
                   global_batch_size=1, vocab_size=1000, ffn_hidden_size=96, swiglu=True, normalization="RMSNorm",
                   add_bias_linear=False, position_embedding_type="rope", untie_embeddings_and_output_weights=True)
cases = [  # (config, MLA?, ModelSpec fields, pre_process)
    (TransformerConfig(**base, qk_layernorm=True, num_query_groups=2), False,
     dict(qk_layernorm=True, num_query_groups=2), True),
    (MLATransformerConfig(**base, **mla, q_lora_rank=None), True, dict(**mla), True),
    (MLATransformerConfig(**base, **mla, q_lora_rank=24, qk_layernorm=True, mtp_num_layers=2, **moe), True,
     dict(**mla, q_lora_rank=24, qk_layernorm=True, mtp_num_layers=2, num_experts=4, moe_ffn_hidden_size=32,
          moe_shared_expert_intermediate_size=48, moe_layer_freq=[0, 1], moe_shared_expert_gate=True), False),
    # gpt-oss's attention: sliding windows on every other layer, a learnable sink logit per head
    (TransformerConfig(**base, num_query_groups=2, window_size=(15, 0), window_attn_skip_freq=2,
                       softmax_type="learnable"), False,
     dict(num_query_groups=2, window_size=(15, 0), window_attn_skip_freq=2, softmax_type="learnable"), True),
]
for cfg, is_mla, fields, pre in cases:
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(cfg, spec.layer_specs[-1], use_transformer_engine=False) if cfg.mtp_num_layers else None
    model = GPTModel(cfg, spec, vocab_size=1024, max_sequence_length=128, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False, pre_process=pre, mtp_block_spec=mtp)
    real = [(n, p.numel()) for n, p in model.named_parameters()]
    m = ModelSpec(**(spec_fields | fields))
    mine = stage_params(m, 1, 2, pre, True, 1, m.moe_layers(0, 2), (4, 1))
    assert real == mine, (real, mine)
print("RESULT ok", flush=True)
"""


@pytest.mark.launch
def test_planner_params_and_buckets_match_megatron_core(tmp_path):
    """The planner's parameter list and DDP bucket sizes against a real megatron-core GPTModel + DDP."""
    script = tmp_path / "check.py"
    script.write_text(MEGATRON_CHECK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = subprocess.run(
        [sys.executable, str(script), str(port)],
        capture_output=True,
        text=True,
        timeout=300,
        env=base_env(),  # this checkout on the path, whatever the installed copy points at
    )
    assert "RESULT ok" in res.stdout, res.stderr[-3000:]


# ---- rank table -------------------------------------------------------------------------------
def test_rank_table_2x8_matches_rank_map():
    nics = parse_nic_text((FIXTURES / "nic_lines_node0.txt").read_text(), "nic_lines_node0.txt")
    parse_nic_text((FIXTURES / "hccn_node1.txt").read_text(), "hccn_node1.txt", nics=nics)
    hosts = ["10.0.0.1", "10.0.0.2"]
    table = build_rank_table(hosts, nics, 8)
    assert table["status"] == "completed" and table["version"] == "1.0" and table["server_count"] == "2"
    rmap = build_rank_map(tp=8, pp=2, nnodes=2, nproc_per_node=8, hosts=hosts)
    for server in table["server_list"]:
        for dev in server["device"]:
            assert all(isinstance(v, str) for v in dev.values())
            entry = rmap.ranks[int(dev["rank_id"])]
            assert hosts[entry.node] == server["server_id"] and entry.local_rank == int(dev["device_id"])
    assert table["server_list"][1]["device"][3] == {"device_id": "3", "device_ip": "192.168.101.104", "rank_id": "11"}
    assert [int(d["rank_id"]) for s in table["server_list"] for d in s["device"]] == list(range(16))


def test_rank_table_json_input_and_cli(tmp_path, capsys):
    nic = tmp_path / "nics.json"
    nic.write_text(json.dumps({"h0": [f"10.1.0.{i}" for i in range(2)], "h1": {"0": "10.1.1.0", "1": "10.1.1.1"}}))
    out = tmp_path / "rank_table.json"
    assert ranktable.main(["--hosts", "h0,h1", "--nproc-per-node", "2", "--nic-file", str(nic), "-o", str(out)]) == 0
    table = json.loads(out.read_text())
    assert table["server_list"][1]["device"][1] == {"device_id": "1", "device_ip": "10.1.1.1", "rank_id": "3"}
    hccn = tmp_path / "h1.txt"
    hccn.write_text("ipaddr:10.1.1.0\nnetmask:255.255.255.0\nipaddr:10.1.1.1\nnetmask:255.255.255.0\n")
    lines = tmp_path / "h0.txt"
    lines.write_text("0 10.1.0.0\n1 10.1.0.1\n")
    assert (
        ranktable.main(["--hosts", "h0,h1", "--nproc-per-node", "2", "--nic", f"h0={lines}", "--nic", f"h1={hccn}"])
        == 0
    )
    assert json.loads(capsys.readouterr().out) == table


@pytest.mark.parametrize(
    "fixture,message",
    [
        ("nic_bad_device.txt", r"nic_bad_device.txt: line 3: device id 'two' is not an integer"),
        ("hccn_bad_ip.txt", r"hccn_bad_ip.txt: line 4: '192.168.101.300' is not an IP address"),
    ],
)
def test_malformed_nic_input_names_the_line(fixture, message):
    with pytest.raises(RankTableError, match=message):
        parse_nic_text((FIXTURES / fixture).read_text(), fixture)


def test_rank_table_refusals(capsys):
    with pytest.raises(RankTableError, match=r"line 1: cannot parse 'what is this line'"):
        parse_nic_text("what is this line\n", "x")
    with pytest.raises(RankTableError, match=r"line 1: 'ipaddr:' before any \[HOST\]"):
        parse_nic_text("ipaddr:1.2.3.4\n", "x")
    nics = parse_nic_text((FIXTURES / "nic_lines_node0.txt").read_text(), "n0")
    with pytest.raises(RankTableError, match=r"host 10.0.0.2: no NIC address for device\(s\) \[0, 1"):
        build_rank_table(["10.0.0.1", "10.0.0.2"], nics, 8)
    with pytest.raises(RankTableError, match="not in --hosts: 10.0.0.1"):
        build_rank_table(["10.0.0.9"], nics, 8)
    assert ranktable.main(["--hosts", "a", "--nic-file", str(FIXTURES / "nic_bad_device.txt")]) == 2
    assert "line 3" in capsys.readouterr().err


# ---- launch script ----------------------------------------------------------------------------
def run_script(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full, timeout=600)


@pytest.mark.launch
def test_script_syntax():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.launch
def test_script_dry_run_prints_both_nodes():
    res = run_script("--dry-run")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "TP groups: all inside one node" in out  # the rank-map check ran
    cmds = [line for line in out.splitlines() if "torch.distributed.run" in line]
    assert len(cmds) == 2
    for node, cmd in enumerate(cmds):
        assert f"--node_rank {node} " in cmd and "--nnodes 2 " in cmd and "--nproc_per_node 8 " in cmd
        assert cmd.split("--master_addr ")[1].split()[0] == "192.168.10.1"
        for flag in (
            "--tensor-model-parallel-size 8",
            "--pipeline-model-parallel-size 2",
            "--num-layers 40",
            "--hidden-size 5120",
            "--num-attention-heads 40",
            "--seq-length 4096",
            "--bf16",
            "--use-distributed-optimizer",
            "--sequence-parallel",
            "--distributed-backend nccl",
            "--lr-decay-style cosine",
            "--timing-log-level 1",
        ):
            assert flag in cmd, flag
        assert re.search(r"\S*pretrain_gpt\.py ", cmd)
    for var in (
        "HCCL_IF_IP",
        "ASCEND_RT_VISIBLE_DEVICES",
        "PYTORCH_NPU_ALLOC_CONF",
        "CUDA_DEVICE_MAX_CONNECTIONS=1",
    ):
        assert out.count(f"export {var}") == 2, var
    assert "export HCCL_IF_IP=192.168.10.2" in out  # node 1's bootstrap address in a dry run
    # HCCL's timeouts follow --distributed-timeout-minutes unless the user exports them
    for var in ("HCCL_EXEC_TIMEOUT", "HCCL_CONNECT_TIMEOUT"):
        assert (f"export {var}" in out) == (var in os.environ), var


@pytest.mark.launch
def test_script_scaled_down_overrides_and_refusals():
    env = dict(
        HOSTS="127.0.0.1,127.0.0.1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29999",
        NPROC_PER_NODE="2",
        TP="2",
        PP="2",
        EXTRA_ARGS="--mock-data --seed 3",
        RANK_MAP_CHECK="0",
    )
    res = run_script("--node-rank", "1", "--dry-run", **env)
    assert res.returncode == 0, res.stderr
    cmds = [line for line in res.stdout.splitlines() if "torch.distributed.run" in line]
    assert len(cmds) == 1 and "--node_rank 1 " in cmds[0] and "--nproc_per_node 2 " in cmds[0]
    assert cmds[0].rstrip().endswith("--mock-data --seed 3") and "--master_port 29999" in cmds[0]
    assert "ASCEND_RT_VISIBLE_DEVICES=0,1\n" in res.stdout
    bad = run_script("--dry-run", TP="16")
    assert bad.returncode == 2 and "TP=16 would span nodes" in bad.stderr
    assert run_script("--node-rank", "5", "--dry-run", RANK_MAP_CHECK="0").returncode == 2
    assert run_script("--bogus").returncode == 2


@pytest.mark.launch
def test_script_cpu_knobs_drop_flags():
    """What tests/test_two_node.py relies on: fp32, no checkpoint paths, timing level 2, SP / dist-opt switches."""
    env = dict(
        RANK_MAP_CHECK="0",
        DTYPE="fp32",
        CHECKPOINT_SAVE="",
        DATA_PATH="",
        TOKENIZER_MODEL="",
        TIMING_LOG_LEVEL="2",
        SEQUENCE_PARALLEL="0",
        DISTRIBUTED_OPTIMIZER="0",
    )
    res = run_script("--node-rank", "0", "--dry-run", **env)
    assert res.returncode == 0, res.stderr
    (cmd,) = [line for line in res.stdout.splitlines() if "torch.distributed.run" in line]
    for gone in (
        "--bf16",
        "--fp16",
        "--save",
        "--load",
        "--data-path",
        "--tokenizer-model",
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--timing-log-level 1",
    ):
        assert f"{gone} " not in cmd, gone
    assert "--timing-log-level 2 " in cmd and "--distributed-backend nccl " in cmd
    assert "--fp16 " in run_script("--dry-run", RANK_MAP_CHECK="0", DTYPE="fp16").stdout
    bad = run_script("--dry-run", RANK_MAP_CHECK="0", DTYPE="fp8")
    assert bad.returncode == 2 and "DTYPE must be bf16, fp16 or fp32" in bad.stderr


def test_plan_full_recompute_repeats_forward_tp_traffic():
    base, again = small_plan().ranks[0].by_label(), small_plan(recompute_full=True).ranks[0].by_label()
    assert again["tp"]["calls"] - base["tp"]["calls"] == 2 * 2 * 4  # 2 forward all-reduces x 2 layers x 4 microbatches
    assert again["tp"]["bytes"] - base["tp"]["bytes"] == 16 * ACT


# ---- MoE: the experts' grid ----------------------------------------------------------------------
def test_rank_map_keeps_expert_groups_inside_a_node_where_they_fit():
    """EP follows expert TP in megatron-core's order: an EP group is ETP x EP contiguous ranks."""
    inside = build_rank_map(tp=2, ep=4, etp=1, nnodes=2, nproc_per_node=8, num_experts=8)
    assert inside.groups["ep"][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert inside.groups["edp"][0] == [0, 4, 8, 12]  # expert DP = 16 / (ETP 1 x EP 4)
    assert "EP groups crossing nodes: 0 of 4" in rankmap.format_table(inside)
    across = build_rank_map(tp=2, ep=8, nnodes=2, nproc_per_node=8, num_experts=16)  # ETP = TP = 2: 16 ranks
    assert "EP groups crossing nodes: 2 of 2" in rankmap.format_table(across)
    with pytest.raises(LayoutError, match=r"--num-experts 6 is not divisible by --ep 4"):
        build_rank_map(ep=4, nnodes=1, nproc_per_node=8, num_experts=6)


def test_plan_counts_the_expert_all_to_all_intra_and_inter_node():
    model = ModelSpec(4, 64, 4, 32, 2, 16, 128, params_dtype="fp32", num_experts=8, moe_router_topk=2)
    pairs = 2 * 32 * 2  # tokens x topk per micro-batch
    per_rank = (4 * pairs * 64 * 4 + 2 * pairs * 4) * 4  # 4 MoE layers, 16 / (2 x DP 8) = 1 micro-batch
    intra = plan(model, build_rank_map(ep=4, etp=1, nnodes=2, nproc_per_node=4, num_experts=8)).ranks[0]
    across = plan(model, build_rank_map(ep=8, etp=1, nnodes=2, nproc_per_node=4, num_experts=8)).ranks[0]
    assert intra.by_label()["ep"]["bytes"] == across.by_label()["ep"]["bytes"] == per_rank
    assert intra.by_label()["ep"]["wire_inter"] == 0 and intra.by_label()["ep"]["wire_intra"] == per_rank * 3 / 4
    assert across.by_label()["ep"]["wire_intra"] == 0 and across.by_label()["ep"]["wire_inter"] == per_rank * 7 / 8
    dense = ModelSpec(4, 64, 4, 32, 2, 16, 128, params_dtype="fp32")
    assert "ep" not in plan(dense, build_rank_map(ep=4, nnodes=2, nproc_per_node=4)).ranks[0].by_label()
