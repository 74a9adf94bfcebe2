"""perf-report, step 1: load a run's log directory and break each rank's iteration into parts.

Reads what ``pretrain_gpt.py --log-dir DIR --timing-log-level 1|2`` writes (``layout.json``,
``args.json``, ``metrics.jsonl``, ``timers/rank*.jsonl``; see megatron_npu.training.timing) and
the ``npu_smi*.txt`` samples a user left beside them. The run's layout is rebuilt once, by
``megatron_npu.layout.rankmap.rank_map_from_run``; the checks and the planner read that map.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_npu.layout.parallel_dims import LayoutError
from megatron_npu.layout.plan_cp_fsdp import fsdp_scheme
from megatron_npu.layout.rankmap import RankMap, rank_map_from_run

# What each part of the iteration breakdown means: printed with every report.
DEFINITIONS = """\
Breakdown of one rank's iteration (seconds; every part is measured, ``other`` is the rest, so the
parts sum to ``iteration_s`` exactly; a negative ``other`` would mean overlapping timers):

  compute            forward_compute_s + backward_compute_s - data_wait_s - tp_comm - fsdp_comm
                     (megatron-core's ``batch-generator`` timer runs inside ``forward-compute``,
                     and so do the TP collectives of the layers and FSDP's)
  data_wait          data_wait_s
  tp_comm            level 2: host seconds in collectives on the TP group (synchronous gloo /
                     blocking HCCL calls) minus the SP/norm-grad all-reduce below; level 1: 0
                     (then inside ``compute``)
  fsdp_comm          FSDP runs, level 2: host seconds in collectives on the DP x CP group (the
                     weights' all-gathers and the gradients' reduce-scatters inside forward and
                     backward); otherwise 0
  tp_grad_sync       the ``non-tensor-parallel-grads-all-reduce`` timer (SP norm/bias grads over TP)
  pp_wait            pp_wait_s: pipeline send/recv waits, bubble included
  embedding_sync     the ``embedding-grads-all-reduce`` timer (tied embedding over the PP ends)
  grad_sync          grad_sync_s: DP gradient all-reduce / reduce-scatter (what overlap left exposed)
  param_gather       param_gather_s: distributed-optimizer param all-gather
  optimizer          optimizer_s - param_gather - small collectives inside the step
  small_collectives  level 2: grad-norm all-reduce (mp / dist_opt groups) and the trainer's
                     loss all-reduce over dp
  other              iteration_s minus all of the above (zero_grad, schedule overhead, ...)

``busy`` (point 3) = compute + optimizer: the rank's own work, nothing that waits on a peer or
the loader. Measured bubble of a stage = pp_wait / forward_backward_s; theoretical 1F1B bubble
(pp-1)/(m+pp-1), interleaved with v virtual stages (pp-1)/(v*m+pp-1), m = micro-batches.
"""

PARTS: tuple[tuple[str, str], ...] = (
    ("compute", "compute"),
    ("data_wait", "data wait"),
    ("tp_comm", "TP comm (in fwd/bwd)"),
    ("fsdp_comm", "FSDP gather/scatter (in fwd/bwd)"),
    ("tp_grad_sync", "TP grad sync (SP/norm)"),
    ("pp_wait", "PP send/recv wait"),
    ("embedding_sync", "embedding grad sync"),
    ("grad_sync", "DP grad sync"),
    ("param_gather", "param all-gather"),
    ("optimizer", "optimizer"),
    ("small_collectives", "grad-norm/loss all-reduce"),
    ("other", "other"),
)
DIMENSIONS: dict[str, tuple[str, ...]] = {
    "TP": ("tp_comm", "tp_grad_sync"),
    "PP": ("pp_wait", "embedding_sync"),
    "DP grad reduce": ("grad_sync",),
    "FSDP gather/scatter": ("fsdp_comm",),
    "param all-gather": ("param_gather",),
    "other collectives": ("small_collectives",),
}
COMM_PARTS = tuple(p for parts in DIMENSIONS.values() for p in parts)


class ReportError(Exception):
    """Bad input: the message names the file or flag to fix."""


@dataclass
class Run:
    log_dir: Path
    args: dict[str, Any]
    layout: dict[str, Any]
    records: dict[int, list[dict[str, Any]]]  # rank -> timer lines
    #: the layout the run ran with: degrees from args.json, nodes from layout.json, every group
    rank_map: RankMap
    metrics: list[dict[str, Any]] = field(default_factory=list)
    npu_smi: dict[str, list[float]] = field(default_factory=dict)


# ---- loading ------------------------------------------------------------------------------------------
def find_log_dir(run_dir: Path) -> Path:
    for candidate in (run_dir, run_dir / "logs"):
        if (candidate / "timers").is_dir():
            return candidate
    raise ReportError(
        f"no timers/ under {run_dir} or {run_dir / 'logs'}: run pretrain_gpt.py with --log-dir DIR --timing-log-level 1 (or 2)"
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if n == len(lines) and out:  # a run killed mid-write leaves a torn last line
                    break
                raise ReportError(f"{path}:{n}: not JSON ({exc.msg})") from None
    return out


def _timer_records(log_dir: Path) -> dict[int, list[dict[str, Any]]]:
    records: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((log_dir / "timers").glob("rank*.jsonl")):
        lines = _read_jsonl(path)
        if lines:
            records[int(lines[0].get("rank", int(path.stem[4:])))] = lines
    if not records:
        raise ReportError(f"{log_dir / 'timers'} holds no records: did the run train any iteration?")
    return records


def _npu_smi_samples(*directories: Path) -> dict[str, list[float]]:
    """AI Core usage lines of every npu_smi*.txt (``Aicore Usage Rate(%) : N``), by file name."""
    samples: dict[str, list[float]] = {}
    for directory in set(directories):
        for path in sorted(directory.glob("npu_smi*.txt")):
            values = [
                float(m.group(1)) for m in re.finditer(r"Aicore Usage Rate\(%\)\s*:\s*([\d.]+)", path.read_text())
            ]
            if values:
                samples[path.name] = values
    return samples


def load_run(run_dir: Path) -> Run:
    log_dir = find_log_dir(run_dir)
    records = _timer_records(log_dir)
    missing = [name for name in ("args.json", "layout.json") if not (log_dir / name).is_file()]
    if missing:
        raise ReportError(f"{log_dir} lacks {', '.join(missing)} (written by pretrain_gpt.py at start-up)")
    args = json.loads((log_dir / "args.json").read_text())
    layout = json.loads((log_dir / "layout.json").read_text())
    try:
        rank_map = rank_map_from_run(args, layout)
    except LayoutError as exc:
        raise ReportError(f"{log_dir}: {exc}") from None
    missing_ranks = sorted(set(records) - {e.rank for e in rank_map.ranks})
    if missing_ranks:
        raise ReportError(f"{log_dir / 'timers'} has ranks {missing_ranks} that layout.json does not list")
    metrics = _read_jsonl(log_dir / "metrics.jsonl") if (log_dir / "metrics.jsonl").is_file() else []
    return Run(log_dir, args, layout, records, rank_map, metrics, _npu_smi_samples(log_dir, run_dir))


# ---- per-record breakdown -----------------------------------------------------------------------------
def _seconds(comm: dict[str, Any], *labels: str) -> float:
    return sum(float(comm.get(label, {}).get("seconds", 0.0)) for label in labels)


def breakdown(record: dict[str, Any], fsdp: bool = False) -> dict[str, float]:
    """The named parts of one rank's iteration; they sum to ``iteration_s`` (``other`` is the rest).
    ``fsdp``: the run shards with FSDP, whose DP x CP collectives run inside forward / backward."""
    raw = record.get("timers", {})
    comm = record.get("comm", {})
    get = lambda key: float(record.get(key, 0.0) or 0.0)  # noqa: E731
    fwd_bwd = get("forward_compute_s") + get("backward_compute_s")
    data = min(get("data_wait_s"), fwd_bwd)
    norm_sync = float(raw.get("non-tensor-parallel-grads-all-reduce", 0.0))
    tp_comm = min(max(_seconds(comm, "tp") - norm_sync, 0.0), fwd_bwd - data)
    fsdp_comm = min(_seconds(comm, "dp_cp"), fwd_bwd - data - tp_comm) if fsdp else 0.0
    param_gather = get("param_gather_s")
    optimizer = max(get("optimizer_s") - param_gather, 0.0)
    in_step = min(_seconds(comm, "mp", "dist_opt"), optimizer)
    parts = {
        "compute": fwd_bwd - data - tp_comm - fsdp_comm,
        "data_wait": data,
        "tp_comm": tp_comm,
        "fsdp_comm": fsdp_comm,
        "tp_grad_sync": norm_sync,
        "pp_wait": get("pp_wait_s"),
        "embedding_sync": max(get("tp_grad_sync_s") - norm_sync, 0.0),
        "grad_sync": get("grad_sync_s"),
        "param_gather": param_gather,
        "optimizer": optimizer - in_step,
        "small_collectives": in_step + _seconds(comm, "dp"),
    }
    parts["other"] = get("iteration_s") - sum(parts.values())
    return parts


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


# ---- per-rank summary ---------------------------------------------------------------------------------
def select_iterations(run: Run, skip: int) -> tuple[list[int], int]:
    """Iterations every rank recorded, less the first ``skip`` (all of them, skip 0, if that leaves none)."""
    common = set.intersection(
        *({r.get("iteration") for r in lines if "iteration_s" in r} for lines in run.records.values())
    )
    ordered = sorted(i for i in common if i is not None)
    if not ordered:
        raise ReportError(
            f"the ranks in {run.log_dir / 'timers'} share no recorded iteration: did the run stop during the first step?"
        )
    return (ordered[skip:], skip) if len(ordered) > skip else (ordered, 0)


@dataclass
class RankSummary:
    """One rank's means over the selected iterations."""

    rank: int
    node: int
    host: str | None
    tp_rank: int
    pp_rank: int
    dp_rank: int
    iteration_s: float
    parts: dict[str, float]
    forward_backward_s: float
    busy_s: float
    comm_s: float
    num_microbatches: int | None
    comm_groups: dict[str, dict[str, float]]


def _comm_groups(lines: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The level-2 counter's calls / bytes / seconds per group label, mean per iteration."""
    out: dict[str, dict[str, float]] = {}
    for r in lines:
        for label, s in r.get("comm", {}).items():
            d = out.setdefault(label, {"calls": 0.0, "bytes": 0.0, "seconds": 0.0})
            for k in d:
                d[k] += float(s.get(k, 0.0)) / len(lines)
    return out


def summarise_ranks(run: Run, iterations: list[int]) -> tuple[list[RankSummary], dict[int, dict[str, float]]]:
    """Per-rank means over ``iterations``, and the per-iteration mean over ranks (for the plot)."""
    ranks: list[RankSummary] = []
    fsdp = fsdp_scheme(run.args) is not None
    per_iteration: dict[int, dict[str, float]] = {}
    for rank in sorted(run.records):
        lines = [r for r in run.records[rank] if r["iteration"] in iterations]
        parts = [breakdown(r, fsdp) for r in lines]
        means = {key: mean([p[key] for p in parts]) for key, _ in PARTS}
        entry = run.rank_map.ranks[rank]
        ranks.append(
            RankSummary(
                rank=rank,
                node=entry.node,
                host=entry.host,
                tp_rank=entry.tp_rank,
                pp_rank=entry.pp_rank,
                dp_rank=entry.dp_rank,
                iteration_s=mean([float(r["iteration_s"]) for r in lines]),
                parts=means,
                forward_backward_s=mean([float(r.get("forward_backward_s", 0.0)) for r in lines]),
                busy_s=means["compute"] + means["optimizer"],
                comm_s=sum(means[p] for p in COMM_PARTS),
                num_microbatches=lines[0].get("num_microbatches") if lines else None,
                comm_groups=_comm_groups(lines),
            )
        )
        for r, p in zip(lines, parts, strict=True):
            acc = per_iteration.setdefault(r["iteration"], {key: 0.0 for key, _ in PARTS} | {"iteration_s": 0.0})
            for key in p:
                acc[key] += p[key] / len(run.records)
            acc["iteration_s"] += float(r["iteration_s"]) / len(run.records)
    return ranks, per_iteration
