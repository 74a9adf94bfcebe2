"""Megatron-LM reduces float64 values (its start-up timestamps: seconds since the epoch,
which float32 would round to minutes). Where the collective library has no float64
all-reduce (HCCL), the patch set reduces them exactly from gathered bytes, so the library
never sees a float64 tensor and every rank gets the exact answer in its own tensor."""

import os
import queue as queues
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_npu.accelerator import get_accelerator
from megatron_npu.patches.distributed import exact_float64_all_reduce
from megatron_npu.registry import REGISTRY
from tests.distributed import free_port

WORLD = 3
HANG_GUARD_S = 600  # only a hang reaches it: a busy 2-core machine spawns and imports slowly
# seconds since the epoch, 1 ms apart: float32 rounds all three to the same value
TIMESTAMPS = [1_764_745_200.125, 1_764_745_200.124, 1_764_745_200.126]


def _library_without_float64(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """torch's all_reduce, refusing float64 as a library without it does."""
    if tensor.dtype == torch.float64:
        raise RuntimeError("float64 reached the collective library")
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    all_reduce = exact_float64_all_reduce(_library_without_float64, get_accelerator())
    answers = {}
    for name in ("MIN", "MAX", "SUM", "AVG", "PRODUCT"):
        tensor = torch.tensor([TIMESTAMPS[rank]], dtype=torch.float64)
        all_reduce(tensor, op=getattr(dist.ReduceOp, name))
        answers[name] = tensor.item()  # the caller's own tensor holds the result
    scalar = torch.tensor(float(rank), dtype=torch.float64)  # 0-d, async
    all_reduce(scalar, op=dist.ReduceOp.MAX, async_op=True).wait()
    answers["async_0d_max"] = scalar.item()
    ints = torch.tensor([rank], dtype=torch.int64)  # other dtypes go to the library untouched
    all_reduce(ints)
    answers["int64_sum"] = ints.item()
    queue.put((rank, answers))
    dist.destroy_process_group()


def _answers(procs: list, queue) -> dict:
    """Every worker's answers, waiting on the workers themselves: a crashed one fails at once, a slow one is
    waited for."""
    answers: dict = {}
    deadline = time.monotonic() + HANG_GUARD_S
    while len(answers) < len(procs):
        try:
            rank, found = queue.get(timeout=1)
            answers[rank] = found
        except queues.Empty:
            crashed = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
            assert not crashed, f"a worker exited with {crashed} before answering"
            assert time.monotonic() < deadline, f"no answer from {len(procs) - len(answers)} workers: a hang"
    return answers


def test_float64_reductions_are_exact_and_never_reach_the_library():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, queue)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    results = _answers(procs, queue)
    for proc in procs:
        proc.join(timeout=HANG_GUARD_S)
        assert proc.exitcode == 0
    values = torch.tensor(TIMESTAMPS, dtype=torch.float64)
    expected = {
        "MIN": values.min().item(),
        "MAX": values.max().item(),
        "SUM": values.sum().item(),
        "AVG": values.mean().item(),
        "PRODUCT": values.prod().item(),
        "async_0d_max": float(WORLD - 1),
        "int64_sum": sum(range(WORLD)),
    }
    assert results == {rank: expected for rank in range(WORLD)}
    assert expected["MIN"] == 1_764_745_200.124  # exact: a float32 detour gives 1764745216.0


def test_the_patch_applies_only_where_the_library_lacks_float64():
    patches = [p for p in REGISTRY.patches if p.name.endswith("all_reduce.float64")]
    assert patches, "the float64 all-reduce patch is registered"
    accelerator = get_accelerator()
    assert all(p.applies_to(accelerator) == (not accelerator.reduces_float64) for p in patches)
    lacking = type("LacksFloat64", (type(accelerator),), {"reduces_float64": False})()
    assert all(p.applies_to(lacking) for p in patches)
