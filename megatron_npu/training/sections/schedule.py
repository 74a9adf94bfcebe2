"""The schedule section: how long the run trains, the global batch size of each step (constant,
ramped up or stepped), the learning-rate and weight-decay schedules, when it evaluates and when it
exits early.
"""

from __future__ import annotations

import argparse
import signal
from dataclasses import dataclass
from typing import Literal

from ...fates import DROP, FlagPolicy
from .base import Section, spec


def signal_named(name: str) -> signal.Signals:
    """--exit-signal's value: a signal by name, as Megatron-LM reads it."""
    try:
        return signal.Signals[name]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)") from None


@dataclass(frozen=True, kw_only=True)
class ScheduleSection(Section):
    """Iterations, batch sizes, learning rate and weight-decay schedules, evaluations and exit conditions (Megatron-LM's TrainingConfig, SchedulerConfig and ValidationConfig)."""

    micro_batch_size: int | None = None
    """Batch size per model instance."""

    global_batch_size: int | None = None
    """Training batch size; micro-batch-size * data-parallel-size if not given."""

    rampup_batch_size: tuple[str, ...] | None = spec(None, nargs="*")
    """<start batch size> <batch size increment> <ramp-up samples>."""

    step_batch_size_schedule: tuple[tuple[int, int], ...] | None = spec(
        None, extension=True, metavar="ITER:GBS", type=str, nargs="+"
    )
    """Step changes of the global batch size, e.g. '0:32 1000:64' (iteration-based training; parsed into a list of
    (iteration, global batch size)).
    """

    train_iters: int | None = None
    """Total number of iterations to train."""

    train_samples: int | None = None
    """Total number of samples to train."""

    eval_iters: int = 100
    """Number of iterations to run for evaluation. Used for both validation and test. If not set, evaluation will
    not run.
    """

    eval_interval: int = 1000
    """Interval between running evaluation on validation set. 0 or unset: no evaluation during training."""

    skip_train: bool = False
    """If set, bypass the training loop, perform evaluation for validation/test, and exit."""

    exit_interval: int | None = None
    """Exit the program after the iteration is divisible by this value."""

    exit_duration_in_mins: int | None = None
    """Exit the program after this many minutes."""

    exit_signal_handler: bool = False
    """Dynamically save the checkpoint and shutdown the training if SIGTERM is received"""

    exit_signal: signal.Signals = spec(signal.SIGTERM, type=signal_named)
    """The signal --exit-signal-handler acts on, by name (default: SIGTERM)."""

    iterations_to_skip: tuple[int, ...] = spec(
        (), fates=(FlagPolicy("--iterations-to-skip", "refused", "skipping chosen iterations is not supported", DROP),)
    )
    """List of iterations to skip during training, empty by default."""

    lr: float | None = None
    """Initial (peak) learning rate."""

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    """Learning rate decay function."""

    lr_wsd_decay_style: Literal["exponential", "linear", "cosine"] = "exponential"
    """Decay style for the annealing phase of WSD"""

    lr_decay_iters: int | None = None
    """number of iterations to decay learning rate over, If None defaults to train iters"""

    lr_decay_samples: int | None = None
    """number of samples to decay learning rate over, If None defaults to train samples"""

    lr_wsd_decay_samples: int | None = None
    """number of samples for the annealing phase in the wsd schedule"""

    lr_wsd_decay_iters: int | None = None
    """number of iterations for the annealing phase in the wsd schedule"""

    lr_warmup_fraction: float | None = None
    """fraction of lr-warmup-(iters/samples) to use for warmup (as a float)"""

    lr_warmup_iters: int = 0
    """number of iterations to linearly warmup learning rate over."""

    lr_warmup_samples: int = 0
    """number of samples to linearly warmup learning rate over."""

    lr_warmup_init: float = 0.0
    """Initial value for learning rate warmup. The scheduler starts warmup from this value."""

    min_lr: float = 0.0
    """Minimum value for learning rate. The scheduler clips values below this threshold."""

    override_opt_param_scheduler: bool = spec(False, "--override-opt_param-scheduler", "--override-opt-param-scheduler")
    """Reset the values of the scheduler (learning rate, warmup iterations, minimum learning rate, maximum number
    of iterations, and decay style) from input arguments and ignore values from checkpoints. Note that all the
    above values will be reset.
    """

    use_checkpoint_opt_param_scheduler: bool = spec(
        False, "--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"
    )
    """Use checkpoint to set the values of the scheduler (learning rate, warmup iterations, minimum learning rate,
    maximum number of iterations, and decay style) from checkpoint and ignore input arguments.
    """

    decoupled_lr: float | None = None
    """Separate learning rate for the input and output layer"""

    decoupled_min_lr: float | None = None
    """Minimum value for learning rate for the input and output layer. The scheduler clips values below this
    threshold
    """

    start_weight_decay: float | None = None
    """Initial weight decay coefficient."""

    end_weight_decay: float | None = None
    """End of run weight decay coefficient."""

    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    """Weight decay increment function."""

    def global_batch_size_at(self, iteration: int) -> int:
        """The global batch of 1-based ``iteration`` under ``--step-batch-size-schedule``."""
        size = self.global_batch_size
        for start, scheduled in self.step_batch_size_schedule or ():
            if iteration - 1 >= start:
                size = scheduled
        return size

    def total_iterations(self) -> int:
        """--train-iters, or the iterations --train-samples takes (with the batch-size ramp-up)."""
        if self.train_iters:
            return self.train_iters
        if not self.rampup_batch_size:
            return self.train_samples // self.global_batch_size
        start, increment, ramp_samples = (int(v) for v in self.rampup_batch_size)
        increments = (self.global_batch_size - start) // increment
        per_increment = ramp_samples / increments if increments else float("inf")
        consumed = iterations = 0
        while consumed < self.train_samples:  # megatron-core's RampupBatchsizeNumMicroBatchesCalculator
            consumed += min(self.global_batch_size, start + int(consumed / per_increment) * increment)
            iterations += 1
        return iterations
