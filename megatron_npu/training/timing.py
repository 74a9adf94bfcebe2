"""Per-rank, per-iteration timers as JSON lines (``--timing-log-level >= 1``).

megatron-core's schedules, DDP and optimizer already time themselves through
``config.timers`` under Megatron-LM's timer names; this module owns that Timers
object and, after each iteration, writes one line per rank to
``LOG_DIR/timers/rank{R:05d}.jsonl`` with the raw timer values and these fields
(seconds, this iteration only):

  iteration_s          wall time of the whole iteration
  forward_backward_s   the pipeline schedule (compute + p2p + in-backward grad reduce)
  forward_compute_s    forward compute inside the schedule
  backward_compute_s   backward compute inside the schedule
  data_wait_s          waiting for the next batch (the ``batch-generator`` timer)
  pp_wait_s            pipeline send/recv waits (all ``*-send*``/``*-recv*`` timers)
  grad_sync_s          DP gradient all-reduce / reduce-scatter wait (``all-grads-sync``)
  tp_grad_sync_s       SP layernorm grads over TP + embedding grads over PP ends
  param_gather_s       distributed-optimizer parameter all-gather (``params-all-gather``)
  optimizer_s          the optimizer step, all-gather included (``optimizer``)

With ``--timing-log-level 2`` each record also has ``comm``: per process group
(tp, pp, dp, dp_cp, embd, mp, dist_opt, world) the calls, payload bytes and host
seconds this rank handed to torch.distributed in the iteration
(megatron_npu.perf.comm; the planner counts bytes the same way).
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

from megatron.core.timers import Timers

from megatron_npu.perf.comm import CommCounter, megatron_groups

PP_TIMER_PREFIXES = ("forward-send", "forward-recv", "backward-send", "backward-recv", "forward-backward-send")
FIELDS = {
    "forward_backward_s": ("forward-backward",),
    "forward_compute_s": ("forward-compute",),
    "backward_compute_s": ("backward-compute",),
    "data_wait_s": ("batch-generator",),
    "grad_sync_s": ("all-grads-sync",),
    "tp_grad_sync_s": ("non-tensor-parallel-grads-all-reduce", "embedding-grads-all-reduce"),
    "param_gather_s": ("params-all-gather",),
    "optimizer_s": ("optimizer",),
}


def build_timers(timing_log_level: int, timing_log_option: str = "minmax") -> Timers:
    # Level 1 already records pipeline waits and compute (level-2 timers in
    # megatron-core): the performance report needs them, and on cpu they cost nothing.
    return Timers(2 if timing_log_level >= 1 else 0, timing_log_option)


def timer_fields(raw: dict[str, float]) -> dict[str, float]:
    fields = {field: sum(raw.get(name, 0.0) for name in names) for field, names in FIELDS.items()}
    fields["pp_wait_s"] = sum(value for name, value in raw.items() if name.startswith(PP_TIMER_PREFIXES))
    return fields


class TimerLog:
    """Writes each iteration's timers (and, at level 2, communication) of this rank, then resets them."""

    def __init__(self, timers: Timers, log_dir: str | None, rank: int, level: int):
        self.timers = timers
        self.enabled = level >= 1 and log_dir is not None
        self._file: IO[str] | None = None
        self.counter: CommCounter | None = None
        if self.enabled:
            os.makedirs(os.path.join(log_dir, "timers"), exist_ok=True)
            self._file = open(os.path.join(log_dir, "timers", f"rank{rank:05d}.jsonl"), "a")
        if self.enabled and level >= 2:
            self.counter = CommCounter().install()
            self.counter.label_groups(megatron_groups())
        self.rank = rank

    def write(self, iteration: int, iteration_s: float, extra: dict[str, Any]) -> None:
        raw = {name: timer.elapsed(reset=True) for name, timer in self.timers._timers.items()}
        if not self._file:
            return
        record = {"rank": self.rank, "iteration": iteration, "iteration_s": iteration_s, **timer_fields(raw)}
        record.update(extra)
        record["timers"] = raw
        if self.counter:
            record["comm"] = {str(group): stats for group, stats in self.counter.snapshot().items()}
            self.counter.reset()
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def discard(self) -> None:
        """Drop time spent outside train steps (evaluation, saving) from the next record."""
        for timer in self.timers._timers.values():
            timer.elapsed(reset=True)
        if self.counter:
            self.counter.reset()

    def close(self) -> None:
        if self.counter:
            self.counter.uninstall()
        if self._file:
            self._file.close()
