"""What a rank actually holds, for ``--memory-report``: the measurement the memory model is checked against.

Two measurements per rank, written as ``LOG_DIR/memory/rankNNNNN.json``:

* **state bytes**, after the first optimizer step (Adam's moments exist from then on): the bytes of
  the distinct storages behind the model's parameters (megatron-core's param buffer under the
  distributed optimizer, padding included), behind ``main_grad`` (DDP's grad buffers, padding
  included), and behind the optimizer's own tensors (fp32 master copies, Adam's ``exp_avg`` and
  ``exp_avg_sq``) that are not already one of the first two (an fp32 model's master copy *is* the
  parameter). Adam's per-parameter ``step`` counters are reported apart (``optimizer_step_bytes``).
* **saved-for-backward bytes**: every tensor autograd saves during one ``forward_backward`` call
  (``torch.autograd.graph.saved_tensors_hooks``), counted once per storage (a view saved twice, or
  by two nodes, holds one storage), parameters and their buffers excluded. ``per_microbatch`` is
  what each forward of each model chunk saved (a micro-batch's first forward per chunk);
  ``peak`` is the most bytes alive at once over the whole schedule (storages tracked by weak
  reference: freed when autograd releases them after their backward), which is what the schedule's
  micro-batches in flight add up to, plus a recomputed layer's working set under full recompute.

Counted on whatever device runs (the cpu target in the tests); no torch_npu allocator statistics.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef


def _storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return storage.data_ptr(), storage.nbytes()


def _distinct_bytes(tensors: Iterable[torch.Tensor], exclude: set[tuple[int, int]]) -> tuple[int, set]:
    """Bytes of the distinct storages behind ``tensors`` not in ``exclude``; and their keys."""
    seen: set[tuple[int, int]] = set()
    for tensor in tensors:
        key = _storage_key(tensor)
        if key is not None and key not in exclude:
            seen.add(key)
    return sum(nbytes for _, nbytes in seen), seen


def _optimizers(optimizer: Any) -> list[Any]:
    """megatron-core's optimizer(s): a ChainedOptimizer (dense + experts) holds several."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def state_bytes(model: list[torch.nn.Module], optimizer: Any) -> dict[str, int]:
    """Parameters, main_grad buffers and optimizer state held by this rank, in bytes."""
    params = [p for chunk in model for p in chunk.parameters()]
    param_bytes, param_keys = _distinct_bytes(params, set())
    grads = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    grad_bytes, grad_keys = _distinct_bytes(grads, param_keys)
    held = param_keys | grad_keys
    masters: list[torch.Tensor] = []
    moments: list[torch.Tensor] = []
    steps: list[torch.Tensor] = []
    for opt in _optimizers(optimizer):
        inner = getattr(opt, "optimizer", opt)  # megatron's wrapper around the torch optimizer
        for group in inner.param_groups:
            masters += list(group["params"])
        for state in inner.state.values():
            for name, value in state.items():
                if torch.is_tensor(value):
                    (steps if name == "step" else moments).append(value)
    master_bytes, master_keys = _distinct_bytes(masters, held)
    moment_bytes, moment_keys = _distinct_bytes(moments, held | master_keys)
    step_bytes, _ = _distinct_bytes(steps, held | master_keys | moment_keys)
    return {
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_bytes": master_bytes + moment_bytes,
        "optimizer_master_bytes": master_bytes,
        "optimizer_moment_bytes": moment_bytes,
        "optimizer_step_bytes": step_bytes,
    }


class SavedTensorTracker:
    """Bytes autograd saves for backward: per forward call (``mark``), and the peak alive at once."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.exclude = {key for key in map(_storage_key, exclude) if key is not None}
        self.alive: dict[tuple[int, int], StorageWeakRef] = {}
        self.alive_bytes = 0
        self.peak = 0
        self.current: set[tuple[int, int]] | None = None
        self.records: list[dict[str, Any]] = []

    def _prune(self) -> None:
        for key in [k for k, ref in self.alive.items() if ref.expired()]:
            del self.alive[key]
            self.alive_bytes -= key[1]

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key is None or key in self.exclude:
            return tensor
        self._prune()
        if key not in self.alive:  # a storage freed and reallocated at the same address is a new one
            self.alive[key] = StorageWeakRef(tensor.untyped_storage())
            self.alive_bytes += key[1]
            self.peak = max(self.peak, self.alive_bytes)
        if self.current is not None:
            self.current.add(key)
        return tensor

    @contextlib.contextmanager
    def active(self) -> Iterator[SavedTensorTracker]:
        """Count every save inside the block (forward, and recomputation inside backward)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield self

    @contextlib.contextmanager
    def forward(self, chunk: int) -> Iterator[None]:
        """One forward of one model chunk: what it saves is recorded as one micro-batch's bytes."""
        self.current = set()
        try:
            yield
        finally:
            self.records.append({"chunk": chunk, "bytes": sum(nbytes for _, nbytes in self.current)})
            self.current = None

    def per_microbatch(self) -> dict[int, int]:
        """Each chunk's first forward (micro-batches of one chunk save the same bytes)."""
        out: dict[int, int] = {}
        for record in self.records:
            out.setdefault(record["chunk"], record["bytes"])
        return out


def wrap_forward_step(forward_step: Callable, tracker: SavedTensorTracker, model: list) -> Callable:
    """``forward_step(data_iterator, model_chunk)`` recording what each call saves, by chunk."""
    index = {id(chunk): i for i, chunk in enumerate(model)}

    def counted(data_iterator: Any, chunk: Any, *rest: Any) -> Any:
        with tracker.forward(index.get(id(chunk), 0)):
            return forward_step(data_iterator, chunk, *rest)

    return counted


def model_tensors(model: list[torch.nn.Module]) -> list[torch.Tensor]:
    """Parameters, their main grads and module buffers: saved by reference, never activations."""
    out: list[torch.Tensor] = []
    for chunk in model:
        for p in chunk.parameters():
            out.append(p)
            if getattr(p, "main_grad", None) is not None:
                out.append(p.main_grad)
        out += list(torch.nn.Module.buffers(chunk))  # DDP shadows .buffers with its grad buffers
    return out


def write_report(log_dir: str, rank: int, report: dict[str, Any]) -> str:
    """``LOG_DIR/memory/rankNNNNN.json``, written aside and renamed (a reader never sees half)."""
    folder = os.path.join(log_dir, "memory")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank{rank:05d}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
    return path


def measure_step(
    run_step: Callable[[Callable], Any], forward_step: Callable, model: list, optimizer: Any
) -> tuple[Any, dict[str, Any]]:
    """Run one training step through ``run_step(forward_step)`` with saved tensors counted; then
    the state bytes (after the step: the optimizer's state exists). Returns the step's result and
    the report."""
    tracker = SavedTensorTracker(exclude=model_tensors(model))
    with tracker.active():
        result = run_step(wrap_forward_step(forward_step, tracker, model))
    report = {
        **state_bytes(model, optimizer),
        "saved_per_microbatch": {str(k): v for k, v in tracker.per_microbatch().items()},
        "saved_peak_bytes": tracker.peak,
        "forwards": len(tracker.records),
    }
    return result, report


def dropout_mask_bytes(dtype: torch.dtype, device: torch.device | str) -> float:
    """Bytes per element the device's dropout saves for backward: a fused kernel's mask (bool, or
    bit-packed), or torch's unfused path's scaled noise in the input's dtype (the cpu target).
    Measured on a small tensor, since which path runs is torch's and the device library's choice."""
    x = torch.ones(4096, dtype=dtype, device=device, requires_grad=True)
    tracker = SavedTensorTracker(exclude=[x])
    with tracker.active():
        y = torch.nn.functional.dropout(x, p=0.5, training=True)
    del y
    return tracker.peak / x.numel()


def reported_step(step: Any, iterators: list, report_dir: str | None, run_flags: Mapping[str, Any]) -> Any:
    """``step(iterators)`` (a TrainStep); with ``--memory-report`` (``report_dir``: LOG_DIR, else None)
    the first step this process runs is measured and ``LOG_DIR/memory/rankNNNNN.json`` written, with
    the memory model's prediction for this rank beside it (megatron_npu.layout.memory, which reads the
    run's flags by Megatron-LM's names, as in args.json: ``run_flags``)."""
    if not report_dir or getattr(step, "_memory_reported", False):
        return step(iterators)
    import torch.distributed as dist

    from megatron_npu.layout.memory import predict_from_args

    original = step.forward_step

    def run(forward_step: Callable) -> Any:
        step.forward_step = forward_step
        try:
            return step(iterators)
        finally:
            step.forward_step = original

    result, report = measure_step(run, original, step.model, step.optimizer)
    step._memory_reported = True
    rank = dist.get_rank()
    try:
        param = next(step.model[0].parameters())
        mask = dropout_mask_bytes(param.dtype, param.device)
        report["predicted"] = predict_from_args(run_flags, rank, dist.get_world_size(), mask).to_json()
    except ValueError as error:  # a layout the model does not cover: the measurement stands alone
        report["predicted_error"] = str(error)
    report["rank"] = rank
    write_report(report_dir, rank, report)
    return result
