"""A two-node job simulated on one machine, and the communication planner against its bytes.

Two launches in all (megatron-core's import costs 5-10 s per process):

* ``two_node``: ``scripts/pretrain_gpt_8x2.sh`` run twice at once (``--node-rank 0`` and
  ``1``, one rendezvous on 127.0.0.1), scaled down through the script's environment
  overrides to 2 "nodes" x 2 ranks, TP2 x PP2 (the script's sequence parallelism and
  distributed optimizer stay on), a 4-layer GPT for 3 iterations on the cpu target;
* ``dp2``: pretrain_gpt.py on 4 ranks, TP2 x DP2 with the distributed optimizer and no
  sequence parallelism (the other TP path, and DP > 1).

Both log ``--timing-log-level 2``: each train iteration's record holds the payload bytes
every rank handed to torch.distributed per process group (megatron_npu.perf.comm), and
the planner must predict them within 2% (the issue's target) for a steady iteration.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from distributed import ROOT, base_env, free_port
from pretrain_runs import pretrain

from megatron_npu.layout.planner import CommPlan, ModelSpec, ParallelSpec, plan
from megatron_npu.layout.rankmap import RankMap, build_rank_map

pytestmark = pytest.mark.launch  # every test here starts processes

SCRIPT = ROOT / "scripts" / "pretrain_gpt_8x2.sh"
TIMEOUT = 900  # both agents on 2 shared cores
TRAIN_ITERS = 3
LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: (\S+) \|")
COMPARED = ("tp", "pp", "dp_cp", "dp", "embd", "mp", "dist_opt")
TOLERANCE = 0.02

# The script's variables, scaled down: 2 nodes x 2 ranks, TP2 x PP2, a tiny GPT on mock data.
TWO_NODE_ENV = {
    "NNODES": "2",
    "NPROC_PER_NODE": "2",
    "TP": "2",
    "PP": "2",
    "HOSTS": "127.0.0.1,127.0.0.1",
    "MASTER_ADDR": "127.0.0.1",
    "NUM_LAYERS": "4",
    "HIDDEN_SIZE": "64",
    "NUM_ATTENTION_HEADS": "4",
    "SEQ_LENGTH": "32",
    "MICRO_BATCH_SIZE": "2",
    "GLOBAL_BATCH_SIZE": "8",
    "TRAIN_ITERS": str(TRAIN_ITERS),
    "LR": "1e-3",
    "MIN_LR": "1e-4",
    "LR_WARMUP_ITERS": "1",
    "EVAL_INTERVAL": "2",
    "EVAL_ITERS": "1",
    "TIMING_LOG_LEVEL": "2",
    "DTYPE": "fp32",  # no --bf16 on the cpu target
    "DATA_PATH": "",
    "TOKENIZER_TYPE": "NullTokenizer",
    "TOKENIZER_MODEL": "",
    "CHECKPOINT_SAVE": "",
    "EXIT_SIGNAL_HANDLER": "0",  # its per-iteration world all-reduce is not in the planner's model (yet)
    "EXTRA_ARGS": "--mock-data --vocab-size 128 --num-workers 0 --seed 1234",
    "PYTHON": sys.executable,
}


# ---- the runs ---------------------------------------------------------------------------------
def run_script_nodes(log_dir: Path, nnodes: int = 2, timeout: float = TIMEOUT) -> list[tuple[int, str, str]]:
    """Both nodes' ``pretrain_gpt_8x2.sh --node-rank N`` at once: [(returncode, stdout, stderr)]."""
    env = base_env(**TWO_NODE_ENV, MASTER_PORT=str(free_port()), LOG_DIR=str(log_dir))
    processes, logs = [], []
    for node in range(nnodes):
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # pipes could fill and stall a node
        logs.append((out, err))
        processes.append(
            subprocess.Popen(
                ["bash", str(SCRIPT), "--node-rank", str(node)],
                env=env,
                cwd=str(ROOT),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            try:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for process in processes:
            if process.poll() is None:  # the whole session: bash, torchrun and its ranks
                subprocess.run(["kill", "-9", "--", f"-{process.pid}"], check=False)
                process.wait()
    results = []
    for process, (out, err) in zip(processes, logs, strict=True):
        out.seek(0)
        err.seek(0)
        results.append((process.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return results


@pytest.fixture(scope="module")
def two_node(tmp_path_factory) -> tuple[Path, list[tuple[int, str, str]]]:
    log_dir = tmp_path_factory.mktemp("two_node") / "logs"
    return log_dir, run_script_nodes(log_dir)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> tuple[Path, object]:
    run_dir = tmp_path_factory.mktemp("dp2")
    job = pretrain(
        run_dir,
        "--tensor-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--train-iters",
        str(TRAIN_ITERS),
        "--timing-log-level",
        "2",
        nproc=4,
        timeout=TIMEOUT,
    )
    return run_dir / "logs", job


def check_exit(results: list[tuple[int, str, str]]) -> None:
    for node, (code, out, err) in enumerate(results):
        assert code == 0, f"node {node} exited {code}\n--- stdout\n{out[-5000:]}\n--- stderr\n{err[-5000:]}"


# ---- planner inputs from the run's own files ---------------------------------------------------
def specs_from_run(args: dict) -> tuple[ModelSpec, ParallelSpec]:
    """The planner's model and parallel settings from LOG_DIR/args.json (the trainer's parsed flags)."""
    dtype = "bf16" if args["bf16"] else "fp16" if args["fp16"] else "fp32"
    model = ModelSpec(
        num_layers=args["num_layers"],
        hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"],
        seq_length=args["seq_length"],
        micro_batch_size=args["micro_batch_size"],
        global_batch_size=args["global_batch_size"],
        vocab_size=args["vocab_size"],
        ffn_hidden_size=args["ffn_hidden_size"],
        num_query_groups=args["num_query_groups"] if args.get("group_query_attention") else None,
        kv_channels=args["kv_channels"],
        swiglu=args["swiglu"],
        untie_embeddings_and_output_weights=args["untie_embeddings_and_output_weights"],
        add_bias_linear=args["add_bias_linear"],
        normalization=args["normalization"],
        position_embedding_type=args["position_embedding_type"],
        max_position_embeddings=args["max_position_embeddings"],
        make_vocab_size_divisible_by=args["make_vocab_size_divisible_by"],
        params_dtype=dtype,
        grad_reduce_in_fp32=bool(args["accumulate_allreduce_grads_in_fp32"] or args["bf16"]),  # the trainer's DDP rule
    )
    parallel = ParallelSpec(
        sequence_parallel=args["sequence_parallel"],
        use_distributed_optimizer=args["use_distributed_optimizer"],
        overlap_grad_reduce=args["overlap_grad_reduce"],
        bucket_size=args.get("ddp_bucket_size"),
        clip_grad=args["clip_grad"],
        recompute_full=args.get("recompute_granularity") == "full",
    )
    return model, parallel


def plan_for_run(log_dir: Path, layout: RankMap) -> CommPlan:
    args = json.loads((log_dir / "args.json").read_text())
    model, parallel = specs_from_run(args)
    assert model.padded_vocab(layout.tp) == args["padded_vocab_size"]  # the planner's vocab padding is the trainer's
    return plan(model, layout, parallel)


def last_iteration_comm(log_dir: Path, world: int) -> dict[int, dict[str, dict]]:
    """{rank: comm of the last train iteration}: eval and saves are reset out of it, so it is one train step."""
    out = {}
    for rank in range(world):
        records = [json.loads(line) for line in (log_dir / "timers" / f"rank{rank:05d}.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in records] == list(range(1, TRAIN_ITERS + 1)), rank
        out[rank] = records[-1]["comm"]
    return out


Row = tuple[
    int, str, int, int, int, int, float
]  # rank, group, planned/measured calls, planned/measured bytes, rel diff


def compare(planned: CommPlan, measured: dict[int, dict[str, dict]]) -> list[Row]:
    """One row per rank and group either side has (an unplanned group, e.g. world, shows as planned 0)."""
    rows = []
    for rp in planned.ranks:
        mine, theirs = rp.by_label(), measured[rp.rank]
        for label in [lb for lb in COMPARED if lb in mine or lb in theirs] + sorted(set(theirs) - set(COMPARED)):
            p, m = mine.get(label, {}), theirs.get(label, {})
            pb, mb = int(p.get("bytes", 0)), int(m.get("bytes", 0))
            diff = abs(pb - mb) / max(mb, 1) if (pb or mb) else 0.0
            rows.append((rp.rank, label, int(p.get("calls", 0)), int(m.get("calls", 0)), pb, mb, diff))
    return rows


def report(title: str, planned: CommPlan, rows: list[Row]) -> str:
    lines = [
        f"==== {title}",
        planned.table(),
        "planner vs measured (last train iteration):",
        f"  {'rank':>4} {'group':8} {'calls plan':>10} {'calls meas':>10} {'bytes plan':>10} {'bytes meas':>10} {'rel diff':>9}",
    ]
    lines += [f"  {r:4d} {g:8} {pc:10d} {mc:10d} {pb:10d} {mb:10d} {d:9.2%}" for r, g, pc, mc, pb, mb, d in rows]
    return "\n".join(lines)


def assert_within(rows: list[Row], text: str) -> None:
    bad = [row for row in rows if row[6] > TOLERANCE]
    assert not bad, f"planner bytes off by more than {TOLERANCE:.0%} on {bad}\n{text}"
    # the planner models each call, not only the total: a count that differs is a missed or extra call
    assert [row[2] for row in rows] == [row[3] for row in rows], text


# ---- tests ------------------------------------------------------------------------------------
def test_two_node_script_run_trains_and_places_ranks(two_node):
    log_dir, results = two_node
    check_exit(results)
    for node, (_, out, _) in enumerate(results):
        assert f"node {node} of 2: " in out and "--node_rank " + str(node) in out  # the script's own launch line
    losses = {int(it): float(loss) for it, loss in LOSS_LINE.findall(results[1][1])}  # last rank lives on node 1
    assert sorted(losses) == list(range(1, TRAIN_ITERS + 1)), results[1][1][-3000:]
    assert all(math.isfinite(v) for v in losses.values()), losses
    assert (log_dir / "node0.log").exists() and (log_dir / "node1.log").exists()

    built = json.loads((log_dir / "layout.json").read_text())
    nodes = {r["rank"]: r["node"] for r in built["ranks"]}
    assert nodes == {0: 0, 1: 0, 2: 1, 3: 1}
    assert {r["rank"]: r["local_rank"] for r in built["ranks"]} == {0: 0, 1: 1, 2: 0, 3: 1}
    assert built["world_size"] == 4
    assert built["groups"]["tp"] == [[0, 1], [2, 3]]  # inside a node
    assert built["groups"]["pp"] == [[0, 2], [1, 3]]  # across the nodes
    for group in built["groups"]["tp"]:
        assert len({nodes[r] for r in group}) == 1
    for group in built["groups"]["pp"]:
        assert len({nodes[r] for r in group}) == 2

    expected = build_rank_map(nnodes=2, nproc_per_node=2, tp=2, pp=2)
    assert {r.rank: r.node for r in expected.ranks} == nodes
    for name in ("tp", "pp", "dp", "cp"):
        assert sorted(expected.groups[name]) == built["groups"][name], name
    for r in built["ranks"]:
        e = expected.ranks[r["rank"]]
        assert (e.local_rank, e.tp_rank, e.pp_rank, e.dp_rank, e.cp_rank) == (
            r["local_rank"],
            r["tp_rank"],
            r["pp_rank"],
            r["dp_rank"],
            r["cp_rank"],
        )


def test_planner_matches_two_node_tp2_pp2_bytes(two_node):
    log_dir, results = two_node
    check_exit(results)
    layout = build_rank_map(nnodes=2, nproc_per_node=2, tp=2, pp=2)
    planned = plan_for_run(log_dir, layout)
    assert planned.parallel.sequence_parallel and planned.parallel.use_distributed_optimizer  # the script's settings
    rows = compare(planned, last_iteration_comm(log_dir, 4))
    text = report("two nodes x 2 ranks, TP2 x PP2 (scripts/pretrain_gpt_8x2.sh, scaled down)", planned, rows)
    print(text)
    assert_within(rows, text)
    # the PP boundary crosses the nodes: the plan counts its p2p as inter-node traffic
    assert all(rp.by_label()["pp"]["wire_inter"] > 0 and rp.by_label()["tp"]["wire_inter"] == 0 for rp in planned.ranks)


def test_planner_matches_dp2_distributed_optimizer_bytes(dp2):
    log_dir, job = dp2
    job.check()
    layout = build_rank_map(nnodes=1, nproc_per_node=4, tp=2, pp=1)
    assert json.loads((log_dir / "layout.json").read_text())["groups"]["dp"] == sorted(layout.groups["dp"])
    planned = plan_for_run(log_dir, layout)
    assert planned.parallel.use_distributed_optimizer and not planned.parallel.sequence_parallel
    rows = compare(planned, last_iteration_comm(log_dir, 4))
    text = report("one node x 4 ranks, TP2 x DP2, distributed optimizer", planned, rows)
    print(text)
    assert_within(rows, text)
    assert {row[1] for row in rows if row[4]} >= {"tp", "dp_cp", "dp", "dist_opt"}
