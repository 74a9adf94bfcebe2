"""CommCounter: exact payload bytes per group on real gloo groups (no torchrun)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.distributed as dist

from megatron_npu.perf.comm import CommCounter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def world1():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_collectives_counted_exactly(world1):
    sub = dist.new_group([0])
    counter = CommCounter().install()
    try:
        counter.label_groups({"world": world1, "tp": sub})
        x = torch.ones(10, dtype=torch.float32)  # 40 bytes
        dist.all_reduce(x)  # default group -> "world"
        dist.all_reduce(torch.ones(3, 5, dtype=torch.bfloat16), group=sub)  # 30 bytes
        dist.broadcast(torch.zeros(7, dtype=torch.int64), src=0, group=sub)  # 56 bytes
        out = [torch.empty(4)]
        dist.all_gather(out, torch.ones(4), group=sub)  # input: 16 bytes
        dist.all_gather_into_tensor(
            torch.empty(6, dtype=torch.float16), torch.ones(6, dtype=torch.float16), group=sub
        )  # 12
        work = dist.all_reduce(torch.ones(2, dtype=torch.float64), group=sub, async_op=True)  # 16
        work.wait()
        dist.all_gather_object([None], {"not": "counted"})
        snap = counter.snapshot()
        by_op = counter.snapshot(by_op=True)
    finally:
        counter.uninstall()
    assert snap["world"]["calls"] == 1 and snap["world"]["bytes"] == 40
    assert snap["tp"]["calls"] == 5
    assert snap["tp"]["bytes"] == 30 + 56 + 16 + 12 + 16
    assert by_op["tp"]["all_reduce"] == {**by_op["tp"]["all_reduce"], "calls": 2, "bytes": 46}
    assert by_op["tp"]["all_gather_into_tensor"]["bytes"] == 12
    assert snap["tp"]["seconds"] >= 0.0
    assert dist.all_reduce.__name__ == "all_reduce" and not hasattr(dist.all_reduce, "__megatron_npu_counted__")


def test_unknown_group_keyed_by_ranks_and_reset(world1):
    with CommCounter() as counter:
        dist.all_reduce(torch.ones(5))
        assert counter.snapshot() == {(0,): {**counter.snapshot()[(0,)], "calls": 1, "bytes": 20}}
        counter.reset()
        assert counter.snapshot() == {}


def test_module_level_aliases_rebound_and_restored():
    """megatron binds dist_all_gather_func = torch.distributed.all_gather_into_tensor at import."""
    import megatron.core.tensor_parallel.mappings as mappings

    fake = types.ModuleType("fake_alias_module")
    fake.all_reduce = dist.all_reduce
    sys.modules["fake_alias_module"] = fake
    original = mappings.dist_all_gather_func
    try:
        counter = CommCounter().install()
        try:
            assert mappings.dist_all_gather_func is dist.all_gather_into_tensor
            assert mappings.dist_all_gather_func is not original
            assert fake.all_reduce is dist.all_reduce
        finally:
            counter.uninstall()
        assert mappings.dist_all_gather_func is original
        assert fake.all_reduce is dist.all_reduce and not hasattr(fake.all_reduce, "__megatron_npu_counted__")
    finally:
        del sys.modules["fake_alias_module"]


WORKER = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    from megatron_npu.perf.comm import CommCounter
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    pp = dist.new_group([0, 1])
    counter = CommCounter().install()
    counter.label_groups({"pp": pp})
    peer = 1 - rank
    t = torch.full((8, 4), float(rank), dtype=torch.bfloat16)  # 64 bytes
    r = torch.empty_like(t)
    # megatron's batch_p2p_comm path: P2POp built from the (wrapped) module attributes
    ops = [dist.P2POp(dist.isend, t, peer, group=pp), dist.P2POp(dist.irecv, r, peer, group=pp)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    assert r[0, 0].item() == peer
    # plain p2p path
    if rank == 0:
        dist.send(t, 1, group=pp); dist.recv(r, 1, group=pp)
    else:
        dist.recv(r, 0, group=pp); dist.send(t, 0, group=pp)
    dist.reduce_scatter_tensor(torch.empty(3), torch.ones(6), group=pp)  # input 24 bytes
    snap = counter.snapshot(by_op=True)
    counter.uninstall()
    print("RESULT", json.dumps(snap["pp"]), flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.launch
def test_p2p_two_processes(tmp_path):
    script = tmp_path / "p2p_worker.py"
    script.write_text(WORKER)
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    for out, _ in outs:
        snap = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[7:])
        assert snap["isend"]["calls"] == 1 and snap["isend"]["bytes"] == 64
        assert snap["irecv"]["calls"] == 1 and snap["irecv"]["bytes"] == 64
        assert snap["send"]["bytes"] == 64 and snap["recv"]["bytes"] == 64
        assert snap["reduce_scatter_tensor"] == {**snap["reduce_scatter_tensor"], "calls": 1, "bytes": 24}
        assert "batch_isend_irecv" not in snap


@pytest.mark.launch
def test_counter_matches_planner_on_a_real_megatron_step():
    """One counted GPT step (DDP + distributed optimizer, world of 1): counter == planner, call for call.

    The same worker runs under torchrun for any layout (TP2, TP2+SP, PP2, DP2 were checked by hand).
    """
    worker = os.path.join(REPO, "tests", "fixtures", "layout", "comm_check_worker.py")
    res = subprocess.run(
        [sys.executable, worker, "--init", f"tcp://127.0.0.1:{_free_port()}", "--dist-opt"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MEGATRON_NPU_DEVICE": "cpu"},
    )
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, res.stderr[-3000:]
    result = json.loads(lines[0][7:])
    assert result["measured"] == result["planned"]
    # megatron's module-level dist_reduce_scatter_func / dist_all_gather_func aliases were counted
    assert set(result["by_op"]["dp_cp"]) == {"reduce_scatter_tensor", "all_gather_into_tensor"}
