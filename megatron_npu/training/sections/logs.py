"""The logging section: the iteration line's interval and extras, timers, TensorBoard, wandb and the
log directory (validation fills ``log_dir``: --tensorboard-dir, else SAVE/logs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...fates import FlagPolicy
from .base import Section, spec


@dataclass(frozen=True, kw_only=True)
class LoggingSection(Section):
    """What the trainer reports and where: the iteration line, timers, TensorBoard, wandb, the log directory (Megatron-LM's LoggerConfig)."""

    log_interval: int = 100
    """Report loss and timing interval."""

    tensorboard_dir: str | None = None
    """Write TensorBoard logs to this directory."""

    log_params_norm: bool = spec(
        False,
        fates=(
            FlagPolicy("--log-params-norm", "ignored", "the parameter norm is not computed; the grad norm is logged"),
        ),
    )
    """If set, calculate and log parameters norm."""

    log_num_zeros_in_grad: bool = False
    """If set, calculate and log the number of zeros in gradient."""

    log_throughput: bool = False
    """If set, calculate and log throughput per GPU."""

    log_progress: bool = spec(
        False,
        fates=(FlagPolicy("--log-progress", "ignored", "progress is the iteration line and LOG_DIR/metrics.jsonl"),),
    )
    """If set, log progress (in terms of number of processed tokens and number of floating-point operations) to
    progress.txt file in checkpoint directory.
    """

    timing_log_level: Literal[0, 1, 2] = 0
    """Granularity level to measure and report timing. 0: report only iteration time and make sure timing does not
    introduce extra overhead. 1: report timing for operations that are executed very limited times (basically
    once) during each iteration (such as gradient all-reduce) 2: report timing for operations that migh be
    executed numerous times during each iteration. Note that setting the level to 1 or 2 might cause increase in
    iteration time.
    """

    log_energy: bool = spec(False, fates=(FlagPolicy("--log-energy", "ignored", "energy counters are CUDA-only"),))
    """If set, log energy consumption (in Joules)."""

    barrier_with_L1_time: bool = spec(  # noqa: N815 (Megatron-LM's dest)
        True,
        "--no-barrier-with-level-1-timing",
        fates=(
            FlagPolicy(
                "--no-barrier-with-level-1-timing",
                "ignored",
                "per-rank timers never barrier: each rank's own waits are what they show",
            ),
        ),
    )  # noqa: N815 (Megatron-LM's dest)
    """If not disabled, use barrier with level 1 time measurements. Note that this is up to the user to make sure
    calling barrier with their timers will not result in hangs. This can happen if for example the user adds a
    level 1 timer that is not called by all ranks.
    """

    timing_log_option: Literal["max", "minmax", "all"] = "minmax"
    """Options for logging timing: max: report the max timing across all ranks minmax: report min and max timings
    across all ranks all: report timings of all ranks.
    """

    tensorboard_log_interval: int = 1
    """Report to tensorboard interval."""

    tensorboard_queue_size: int = 1000
    """Size of the tensorboard queue for pending events and summaries before one of the 'add' calls forces a flush
    to disk.
    """

    log_timers_to_tensorboard: bool = spec(
        False,
        fates=(
            FlagPolicy(
                "--log-timers-to-tensorboard",
                "ignored",
                "timers go to LOG_DIR/timers/*.jsonl (--timing-log-level 1), not TensorBoard",
            ),
        ),
    )
    """If set, write timers to tensorboard."""

    log_loss_scale_to_tensorboard: bool = spec(
        True,
        "--no-log-loss-scale-to-tensorboard",
        "--disable-log-loss-scale-to-tensorboard",
        fates=(
            FlagPolicy(
                "--no-log-loss-scale-to-tensorboard", "ignored", "the loss scale is always written to TensorBoard"
            ),
            FlagPolicy(
                "--disable-log-loss-scale-to-tensorboard", "ignored", "the loss scale is always written to TensorBoard"
            ),
        ),
    )
    """Disable loss-scale logging to tensorboard."""

    log_validation_ppl_to_tensorboard: bool = spec(
        False,
        fates=(
            FlagPolicy(
                "--log-validation-ppl-to-tensorboard",
                "ignored",
                "validation perplexity is always written to TensorBoard",
            ),
        ),
    )
    """If set, write validation perplexity to tensorboard."""

    log_memory_to_tensorboard: bool = spec(
        False, fates=(FlagPolicy("--log-memory-to-tensorboard", "ignored", "memory is not logged to TensorBoard"),)
    )
    """Enable memory logging to tensorboard."""

    log_world_size_to_tensorboard: bool = spec(
        False,
        fates=(FlagPolicy("--log-world-size-to-tensorboard", "ignored", "the world size is in LOG_DIR/args.json"),),
    )
    """Enable world size logging to tensorboard."""

    wandb_project: str | None = None
    """The wandb project name. Ignore wandb by default."""

    wandb_exp_name: str | None = None
    """The wandb experiment name."""

    wandb_save_dir: str | None = None
    """Path to save the wandb results locally."""

    wandb_entity: str | None = None
    """The wandb entity name. It is useful when there are multiple sub-projects in a project."""

    logging_level: int | None = spec(
        None, fates=(FlagPolicy("--logging-level", "ignored", "the trainer prints on rank 0 / the last rank only"),)
    )
    """Set default logging level"""

    log_dir: str | None = spec(None, extension=True)
    """directory for the timers JSON and layout.json (the trainer picks one if not given)."""
