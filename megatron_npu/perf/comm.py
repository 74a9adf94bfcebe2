"""Count what a process hands to torch.distributed: calls, payload bytes and seconds per group.

``bytes`` is the payload: ``numel * element_size`` of the tensor(s) passed in, namely the
tensor of all_reduce / broadcast / send / recv (receives count), the *input* of
all_gather(_into_tensor|_single) (this rank's shard) and of reduce_scatter(_tensor|_single) (the
full input). ``megatron_npu.layout.planner`` uses the same definition, so a plan can be checked
against a run. ``seconds`` is host wall time inside the call: for async ops (and ops inside
a ``_coalescing_manager``) the time to return, not the transfer time.

Object collectives (all_gather_object, ...) are not counted. torch-internal calls from one
counted function into another (batch_isend_irecv -> isend) are counted once; each P2POp of
a batch_isend_irecv is recorded as an isend/irecv call (the batch's seconds split evenly),
so batched and unbatched p2p give the same figures. c10d's own isend/irecv globals are
wrapped too, because P2POp validates ``op`` against them.

megatron-core binds some functions by value at import (``dist_all_gather_func =
torch.distributed.all_gather_into_tensor`` in tensor_parallel.mappings / layers and
distributed.param_and_grad_buffer), so install() also rebinds every module-level alias of
a wrapped function outside torch, and uninstall() undoes it. An alias bound before a patch
replaced the function (megatron-core imported ahead of megatron_npu) holds what the patch wraps
(``__wrapped__``), or another patch of the same function: it is counted too.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# name -> (argument holding the payload, how to size it)
_OPS: dict[str, str] = {
    "all_reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "_all_gather_base": "input_tensor",
    "all_gather_single": "input_tensor",  # torch 2.13's FSDP2 gathers and scatters with the *_single pair
    "reduce_scatter_tensor": "input",
    "_reduce_scatter_base": "input",
    "reduce_scatter_single": "input",
    "reduce_scatter": "input_list",
    "broadcast": "tensor",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
    "all_to_all_single": "input",
    "batch_isend_irecv": "p2p_op_list",
}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


GroupKey = str | tuple[int, ...]


def _innermost(function: Any) -> Any:
    """What a chain of functools.wraps wrappers (patches) finally calls; ``function`` itself if none."""
    for _ in range(32):  # patches stack a few deep; the bound guards a cycle
        inner = getattr(function, "__wrapped__", None)
        if not isinstance(inner, types.FunctionType):
            break
        function = inner
    return function


class CommCounter:
    """Wraps torch.distributed's collectives and p2p calls while installed.

    >>> counter = CommCounter().install()
    >>> counter.label_groups({"tp": tp_group, "dp": dp_group})
    >>> ...; counter.snapshot()  # {"tp": {"calls": n, "bytes": b, "seconds": s}, ...}
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._labels: dict[int, tuple[Any, str]] = {}  # id(group) -> (group, label); keeps group alive
        self._stats: dict[tuple[GroupKey, str], list[float]] = {}
        self._originals: dict[str, Callable] = {}
        self._wrappers: dict[str, Callable] = {}
        self._aliases: list[tuple[Any, str, Callable]] = []
        self.installed = False

    # ---- groups -------------------------------------------------------------------------
    def label_groups(self, mapping: dict[str, Any]) -> None:
        """Name process groups; the first label given to a group object wins. None entries are skipped."""
        for label, group in mapping.items():
            if group is not None and id(group) not in self._labels:
                self._labels[id(group)] = (group, label)

    def _key(self, group: Any) -> GroupKey:
        if group is None:
            group = dist.group.WORLD
        hit = self._labels.get(id(group))
        if hit is not None and hit[0] is group:
            return hit[1]
        try:
            return tuple(sorted(dist.get_process_group_ranks(group)))
        except Exception:  # a group this rank is not in, or no default group yet
            return ("?",)

    # ---- recording ----------------------------------------------------------------------
    def _record(self, group: Any, op: str, nbytes: int, seconds: float, calls: int = 1) -> None:
        key = (self._key(group), op)
        with self._lock:
            s = self._stats.setdefault(key, [0, 0, 0.0])
            s[0] += calls
            s[1] += nbytes
            s[2] += seconds

    def reset(self) -> None:
        with self._lock:
            self._stats.clear()

    def snapshot(self, by_op: bool = False) -> dict:
        """{group: {"calls", "bytes", "seconds"}}; with by_op, {group: {op: {...}}}."""
        out: dict = {}
        with self._lock:
            items = list(self._stats.items())
        for (group, op), (calls, nbytes, seconds) in items:
            if by_op:
                out.setdefault(group, {})[op] = {"calls": int(calls), "bytes": int(nbytes), "seconds": seconds}
            else:
                d = out.setdefault(group, {"calls": 0, "bytes": 0, "seconds": 0.0})
                d["calls"] += int(calls)
                d["bytes"] += int(nbytes)
                d["seconds"] += seconds
        return out

    # ---- wrapping -----------------------------------------------------------------------
    def _wrap(self, name: str, original: Callable) -> Callable:
        sig = inspect.signature(original)
        payload_arg = _OPS[name]
        local = self._local

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "depth", 0):  # torch calling torch: the outer call is counted
                return original(*args, **kwargs)
            try:
                bound = sig.bind(*args, **kwargs).arguments
            except TypeError:
                return original(*args, **kwargs)  # let torch raise its own error
            if name == "batch_isend_irecv":
                # torch picks the peer keyword with `op.op is isend` (c10d's global, now the
                # wrapper): P2POps built before install() get the wrapper too
                swap = {id(self._originals[n]): self._wrappers[n] for n in ("isend", "irecv") if n in self._originals}
                for p2p in bound.get("p2p_op_list") or []:
                    if id(p2p.op) in swap:
                        p2p.op = swap[id(p2p.op)]
            local.depth = 1
            start = time.perf_counter()
            try:
                result = original(*args, **kwargs)
            finally:
                local.depth = 0
            seconds = time.perf_counter() - start
            if name == "batch_isend_irecv":  # one entry per P2POp, so batched and plain p2p compare
                ops = list(bound.get("p2p_op_list") or [])
                for p2p in ops:
                    kind = "isend" if "send" in getattr(p2p.op, "__name__", "") else "irecv"
                    self._record(p2p.group, kind, _nbytes(p2p.tensor), seconds / max(len(ops), 1))
            else:
                self._record(bound.get("group"), name, _nbytes(bound.get(payload_arg)), seconds)
            return result

        counted.__megatron_npu_counted__ = True  # type: ignore[attr-defined]
        return counted

    def install(self) -> CommCounter:
        if self.installed:
            return self
        for name in _OPS:
            original = getattr(dist, name, None)
            if original is None or getattr(original, "__megatron_npu_counted__", False):
                continue
            self._originals[name] = original
            self._wrappers[name] = self._wrap(name, original)
            setattr(dist, name, self._wrappers[name])
        # P2POp(op=...) checks op against c10d's own isend/irecv, and batch_isend_irecv
        # tests `op.op is isend`: those two globals must be the wrappers as well
        c10d = dist.distributed_c10d
        for name in ("isend", "irecv"):
            if name in self._originals and getattr(c10d, name, None) is self._originals[name]:
                setattr(c10d, name, self._wrappers[name])
                self._aliases.append((c10d, name, self._originals[name]))
        # an alias may hold the function as another patch of it wraps it (torch.distributed and
        # c10d are patched apart): same innermost function, same collective
        by_root = {id(_innermost(f)): n for n, f in self._originals.items()}
        for mod_name, module in list(sys.modules.items()):
            if module is None or (mod_name.startswith("torch") and mod_name != "torch.distributed"):
                continue
            try:
                attrs = list(vars(module).items())
            except TypeError:
                continue
            for attr, value in attrs:
                if not isinstance(value, types.FunctionType) or getattr(value, "__megatron_npu_counted__", False):
                    continue
                name = by_root.get(id(_innermost(value)))
                if name is not None and module is not dist:
                    setattr(module, attr, self._wrappers[name])
                    self._aliases.append((module, attr, value))
        self.installed = True
        return self

    def uninstall(self) -> None:
        if not self.installed:
            return
        for name, original in self._originals.items():
            if getattr(dist, name) is self._wrappers[name]:
                setattr(dist, name, original)
        for module, attr, original in self._aliases:
            setattr(module, attr, original)
        # modules imported while installed bound the wrapper: give them the original back
        wrappers = {id(w): n for n, w in self._wrappers.items()}
        for module in list(sys.modules.values()):
            try:
                attrs = list(vars(module).items()) if module is not None else []
            except TypeError:
                continue
            for attr, value in attrs:
                name = wrappers.get(id(value))
                if name is not None and value is self._wrappers[name]:
                    setattr(module, attr, self._originals[name])
        self._originals.clear()
        self._wrappers.clear()
        self._aliases.clear()
        self.installed = False

    def __enter__(self) -> CommCounter:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def megatron_groups() -> dict[str, Any]:
    """megatron-core's process groups under the labels the planner and the report use."""
    from megatron.core import parallel_state as ps

    # the CP attention's ring / all-to-all (ops/context_parallel.py), and the two levels of a2a+p2p
    hierarchical = ps.get_hierarchical_context_parallel_groups(check_initialized=False) or [None, None]
    return {
        "tp": ps.get_tensor_model_parallel_group(),
        "cp": ps.get_context_parallel_group(check_initialized=False),
        "cp_a2a": hierarchical[0],
        "cp_ring": hierarchical[1],
        "pp": ps.get_pipeline_model_parallel_group(),
        "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
        "dp": ps.get_data_parallel_group(),
        "embd": ps.get_embedding_group(check_initialized=False),
        "mp": ps.get_model_parallel_group(),
        "dist_opt": ps.get_intra_distributed_optimizer_instance_group(),
        # MoE: the token all-to-all (EP) and the expert parameters' gradient reduction (expert DP)
        "ep": ps.get_expert_model_parallel_group(check_initialized=False),
        "edp": ps.get_expert_data_parallel_group(check_initialized=False),
        # the router and dispatcher's small collectives: token counts, the expert grad norm, the aux loss
        "tp_ep": ps.get_expert_tensor_and_model_parallel_group(check_initialized=False),
        "expert_mp": ps.get_expert_tensor_model_pipeline_parallel_group(check_initialized=False),
        "tp_cp": ps.get_tensor_and_context_parallel_group(check_initialized=False),
        "world": dist.group.WORLD,
    }
