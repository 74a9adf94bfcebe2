"""Faults during training: a non-finite loss, and the test seam that injects faults.

``--check-for-nan-in-loss-and-grad`` (on by default, as in Megatron-LM): Megatron-LM checks
each micro-batch's loss before the data-parallel reduction in its pretrain_gpt.py
``loss_func`` (megatron-core's rerun state machine, which raises ``RuntimeError`` with a
traceback and no iteration unless Megatron-LM's loop drives it). This project's
pretrain_gpt.py, like a script written for an older Megatron-LM, has no such check, so the
trainer wraps whatever loss function the forward step returns and stops with one line
naming the iteration and rank. megatron-core's DDP checks the gradients itself
(``ddp_config.check_for_nan_in_grad``); its error is said again as one line (non_finite_grad).

``MEGATRON_NPU_INJECT_FAULT=KIND@ITERATION[:RANK,...]`` is a test seam: the trainer calls
``fire()`` at the start of each iteration and ``fire_in_save()`` between writing a
checkpoint and publishing it, and the named ranks (all when none are named) then
``kill`` themselves with SIGKILL, ``raise`` an exception, poison a parameter with ``nan``,
poison a parameter's gradient with ``nan-grad`` (from that iteration on), ``hang`` (sleep, as a rank stuck on its device) or ``pause-save`` (sleep inside the save, so
a test can kill the job mid-save).
"""

from __future__ import annotations

import functools
import math
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

INJECT_ENV = "MEGATRON_NPU_INJECT_FAULT"
KINDS = ("kill", "raise", "nan", "nan-grad", "hang", "pause-save")
PAUSE_S = 3600.0  # longer than any test waits: a job that ends did not wait it out


class NonFiniteValue(Exception):
    """A NaN or Inf that stops training; the rank that found it is the failure's origin."""


class NonFiniteLoss(NonFiniteValue):
    """A micro-batch's loss is NaN or Inf on this rank (the rank that computes the loss)."""


class NonFiniteGrad(NonFiniteValue):
    """A gradient is NaN or Inf on this rank before the data-parallel reduction."""


# megatron-core 0.16's DDP gradient check (param_and_grad_buffer.check_grads) raises a bare
# RuntimeError through its rerun state machine, whose iteration this loop does not drive (it
# says 0): recognised by its message and said again as one line with the real iteration.
_MCORE_GRAD_CHECK = re.compile(r"found (NaN|Inf) in local grad norm for bucket #(\d+)")


def non_finite_grad(error: BaseException, iteration: int) -> NonFiniteGrad | None:
    """The NonFiniteGrad that megatron-core's gradient check ``error`` reports, else None."""
    found = _MCORE_GRAD_CHECK.search(str(error)) if isinstance(error, RuntimeError) else None
    if found is None:
        return None
    value, bucket = found.group(1).lower(), found.group(2)
    return NonFiniteGrad(
        f"iteration {iteration}: a gradient is {value} on rank {dist.get_rank()} (bucket #{bucket}) before the "
        "data-parallel reduction while the loss is finite; training stops (--check-for-nan-in-loss-and-grad, "
        "on by default: lower --lr, raise --clip-grad, or use --bf16 over --fp16; resume from the last "
        "checkpoint with --load)"
    )


class InjectedFault(RuntimeError):
    """The exception ``raise`` injects."""


def check_loss_func(loss_func: Callable, iteration: Callable[[], int]) -> Callable:
    """``loss_func`` raising NonFiniteLoss when the loss it returns is not finite."""

    @functools.wraps(loss_func)
    def checked(output_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        outputs = loss_func(output_tensor, *args, **kwargs)
        if kwargs.get("non_loss_data"):
            return outputs
        loss = outputs[0].detach().float().sum().item()
        if not math.isfinite(loss):
            raise NonFiniteLoss(
                f"iteration {iteration()}: the loss is {loss} on rank {dist.get_rank()}; training stops "
                "(--check-for-nan-in-loss-and-grad, on by default: lower --lr, raise --clip-grad, or check "
                "the data of this iteration; resume from the last checkpoint with --load)"
            )
        return outputs

    return checked


def check_forward_step(forward_step: Callable, iteration: Callable[[], int]) -> Callable:
    """``forward_step`` whose loss function is checked by check_loss_func."""

    @functools.wraps(forward_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        output_tensor, loss_func = forward_step(*args, **kwargs)
        return output_tensor, check_loss_func(loss_func, iteration)

    return step


@dataclass(frozen=True)
class FaultPlan:
    kind: str
    iteration: int
    ranks: tuple[int, ...]  # empty: every rank

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        spec = os.environ.get(INJECT_ENV)
        if not spec:
            return None
        kind, _, where = spec.partition("@")
        iteration, _, ranks = where.partition(":")
        if kind not in KINDS or not iteration.isdigit():
            raise ValueError(f"{INJECT_ENV}={spec!r}: expected KIND@ITERATION[:RANK,...], KIND one of {KINDS}")
        return cls(kind, int(iteration), tuple(int(r) for r in ranks.split(",") if r))

    def _here(self, iteration: int) -> bool:
        return iteration == self.iteration and (not self.ranks or dist.get_rank() in self.ranks)

    def fire(self, iteration: int, model: list) -> None:
        """At the start of ``iteration``, before its step."""
        if not self._here(iteration):
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "raise":
            raise InjectedFault(f"{INJECT_ENV}: injected on rank {dist.get_rank()} at iteration {iteration}")
        if self.kind == "nan":
            with torch.no_grad():
                next(model[0].parameters()).fill_(float("nan"))
        if self.kind == "nan-grad":  # the loss stays finite: only the backward pass sees the NaN
            next(model[0].parameters()).register_hook(lambda grad: torch.full_like(grad, float("nan")))
        if self.kind == "hang":
            time.sleep(PAUSE_S)

    def fire_in_save(self, iteration: int) -> None:
        """Between writing checkpoint ``iteration`` and publishing it."""
        if self.kind == "pause-save" and self._here(iteration):
            print(f"{INJECT_ENV}: rank {dist.get_rank()} pausing in the save of iteration {iteration}", flush=True)
            time.sleep(PAUSE_S)
