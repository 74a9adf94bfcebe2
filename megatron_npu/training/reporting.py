"""Megatron-LM's iteration and validation lines, TensorBoard scalars, metrics JSON lines.

The line shapes are Megatron-LM's (training.py ``training_log``), so dashboards and
scripts that parse them keep working. ``LOG_DIR/metrics.jsonl`` carries the same
figures at full precision, one line per iteration (the last rank writes it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from datetime import datetime
from typing import IO, Any

from megatron_npu.training.sections import LoggingSection, ModelSection, MoeSection

SEPARATOR = "-" * 100


@dataclasses.dataclass(frozen=True)
class ModelFlops:
    """Model FLOPs of one iteration (forward + backward), Megatron-LM's dense-GPT formula, from the
    validated model section (kv channels, query groups, ffn size resolved), the sequence length and
    the tokenizer's vocabulary padded for TP."""

    model: ModelSection
    seq_length: int
    padded_vocab_size: int

    def per_iteration(self, batch_size: int) -> float:
        m = self.model
        query_projection_ratio = m.kv_channels * m.num_attention_heads / m.hidden_size
        gated_multiplier = 3 / 2 if m.swiglu else 1
        return (
            12  # 3 passes (fwd, 2x bwd) x 2 FLOPs per multiply-add x 2 GEMMs per projection pair
            * batch_size
            * self.seq_length
            * m.num_layers
            * m.hidden_size**2
            * (
                (1 + m.num_query_groups / m.num_attention_heads + self.seq_length / m.hidden_size)
                * query_projection_ratio
                + (m.ffn_hidden_size / m.hidden_size) * gated_multiplier
                + self.padded_vocab_size / (2 * m.num_layers * m.hidden_size)
            )
        )


def moe_track_names(moe: MoeSection) -> list[str]:
    """The MoE losses Megatron-LM's training_log tracks, by its names."""
    balancing = moe.moe_router_load_balancing_type
    # Megatron-LM tests `"aux_loss" in` the collapsed string, so seq_aux_loss alone also prints a
    # load_balancing_loss of 0; a list of the types tracks only those given.
    balancing = [balancing] if isinstance(balancing, str) else balancing
    names = [
        name
        for kind, name in (
            ("aux_loss", "load_balancing_loss"),
            ("seq_aux_loss", "seq_load_balancing_loss"),
            ("global_aux_loss", "global_load_balancing_loss"),
        )
        if kind in balancing
    ]
    if moe.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def moe_losses(
    moe: MoeSection, model: ModelSection, num_microbatches: int, iteration: int, writer: Any
) -> dict[str, float]:
    """This iteration's MoE aux losses (each the mean over the MoE layers, scaled by 1 / micro-batches,
    as Megatron-LM's training_log), from megatron-core's tracker, which this clears; every rank calls
    it (the tracker is reduced across the pipeline and data-parallel groups). ``writer``: TensorBoard
    or None, scalars under the same names as Megatron-LM's."""
    import torch
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    from megatron_npu.accelerator import get_accelerator
    from megatron_npu.compat import moe_layer_wise_logging_tracker as get_moe_layer_wise_logging_tracker

    names = moe_track_names(moe)
    # Every rank needs every name (a pipeline stage with no MoE layer still joins the reduce):
    # megatron-core's force_initialize allocates them on device "cuda" literally, so they are made here.
    tracker = get_moe_layer_wise_logging_tracker()
    # megatron-core's router sizes the tracker with the MTP layers too: every stage must hold the same size
    layers = model.num_layers + (model.mtp_num_layers or 0)
    for name in names:
        if name not in tracker:
            values = torch.zeros(layers, device=get_accelerator().device())
            tracker[name] = {"values": values, "reduce_group": None, "avg_group": None, "reduce_group_has_dp": False}
    totals: dict[str, Any] = {}
    # as Megatron-LM's training_log, the mean counts MTP's MoE layers; passed only with MTP (0.12's
    # track_moe_metrics has no such argument, and the trainer refuses MTP there at start-up)
    with_mtp = {"mtp_num_layers": model.mtp_num_layers} if model.mtp_num_layers else {}
    track_moe_metrics(
        loss_scale=1 / num_microbatches,
        iteration=iteration,
        writer=writer,
        total_loss_dict=totals,
        per_layer_logging=moe.moe_per_layer_logging,
        force_initialize=True,
        track_names=names,
        num_layers=model.num_layers,
        # megatron-core tells a pattern from a frequency by isinstance(list): the section holds a tuple
        moe_layer_freq=moe.moe_layer_freq if isinstance(moe.moe_layer_freq, int) else list(moe.moe_layer_freq),
        **with_mtp,
    )
    return {name: float(value) for name, value in totals.items()}


def iteration_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_s: float,
    throughput_tflops: float | None,
    learning_rate: float,
    global_batch_size: int,
    losses: dict[str, float],
    loss_scale: float,
    grad_norm: float | None,
    skipped: int,
    nans: int,
    mfu: float | None = None,
    num_zeros: float | None = None,
    decoupled_learning_rate: float | None = None,
) -> str:
    line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
    line += f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed_s * 1000.0:.1f} |"
    if throughput_tflops is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {throughput_tflops:.1f} |"
    if mfu is not None:
        line += f" MFU: {mfu * 100:.1f}% |"
    line += f" learning rate: {learning_rate:.6E} |"
    if decoupled_learning_rate is not None:
        line += f" decoupled learning rate: {decoupled_learning_rate:.6E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    for key, value in losses.items():
        line += f" {key}: {value:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if num_zeros is not None:
        line += f" num zeros: {num_zeros:.1f} |"
    line += f" number of skipped iterations: {skipped:3d} |"
    line += f" number of nan iterations: {nans:3d} |"
    return line


def validation_lines(prefix: str, losses: dict[str, float]) -> str:
    text = f" validation loss {prefix} |"
    for key, value in losses.items():
        text += f" {key} value: {value:.6E} | {key} PPL: {math.exp(min(20.0, value)):.6E} |"
    return f"{SEPARATOR}\n{text}\n{SEPARATOR}"


_WANDB_RUN: Any = None


def wandb_run(logging: LoggingSection, save: str | None, run_flags: Mapping[str, Any]) -> Any:
    """Megatron-LM's wandb writer: one run per job, opened by the last rank on first use,
    in --wandb-save-dir (default SAVE/wandb); None without --wandb-project. ``run_flags``: every
    flag's value, the run's wandb config (as Megatron-LM's)."""
    global _WANDB_RUN
    if _WANDB_RUN is None and logging.wandb_project:
        import wandb

        save_dir = logging.wandb_save_dir or os.path.join(save, "wandb")
        os.makedirs(save_dir, exist_ok=True)
        config = {
            k: v if isinstance(v, (bool, int, float, str, list, tuple, type(None))) else str(v)
            for k, v in run_flags.items()
        }
        _WANDB_RUN = wandb.init(
            dir=save_dir,
            project=logging.wandb_project,
            name=logging.wandb_exp_name,
            entity=logging.wandb_entity or None,
            config=config,
        )
    return _WANDB_RUN


def finish_wandb() -> None:
    global _WANDB_RUN
    if _WANDB_RUN is not None:
        _WANDB_RUN.finish()
        _WANDB_RUN = None


class MetricsWriter:
    """TensorBoard scalars and wandb values under Megatron-LM's tag names, and metrics.jsonl;
    last rank only. ``save`` (--save) and ``run_flags`` (every flag's value) only for wandb's
    default directory and config."""

    def __init__(
        self,
        logging: LoggingSection,
        is_last_rank: bool,
        *,
        save: str | None = None,
        run_flags: Mapping[str, Any] | None = None,
    ):
        self.enabled = is_last_rank
        self.tensorboard: Any = None
        self.jsonl: IO[str] | None = None
        self.wandb: Any = None
        if not is_last_rank:
            return
        self.wandb = wandb_run(logging, save, run_flags or {})
        if logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=logging.tensorboard_dir, max_queue=logging.tensorboard_queue_size)
        if logging.log_dir:
            os.makedirs(logging.log_dir, exist_ok=True)
            self.jsonl = open(os.path.join(logging.log_dir, "metrics.jsonl"), "a")
        self.interval = logging.tensorboard_log_interval

    def train(self, iteration: int, consumed_samples: int, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.jsonl:
            self.jsonl.write(
                json.dumps({"iteration": iteration, "consumed_samples": consumed_samples, **record}) + "\n"
            )
            self.jsonl.flush()
        if (self.tensorboard or self.wandb) and iteration % self.interval == 0:
            tags = {
                "learning-rate": record["learning_rate"],
                "decoupled-learning-rate": record.get("decoupled_learning_rate"),
                "batch-size": record["global_batch_size"],
                "lm loss": record["lm_loss"],
                "loss-scale": record["loss_scale"],
                "grad-norm": record["grad_norm"],
                "iteration-time": record["iteration_s"],
                "throughput": record.get("throughput_tflops"),
            }
            tags = {tag: value for tag, value in tags.items() if value is not None and math.isfinite(value)}
            if self.tensorboard:
                for tag, value in tags.items():
                    self.tensorboard.add_scalar(tag, value, iteration)
                    self.tensorboard.add_scalar(f"{tag} vs samples", value, consumed_samples)
            if self.wandb:
                self.wandb.log({**tags, "samples": consumed_samples}, step=iteration)

    def evaluation(self, iteration: int, consumed_samples: int, losses: dict[str, float], split: str) -> None:
        """``split`` is "validation" or "test": the metrics.jsonl key and the TensorBoard tag suffix."""
        if not self.enabled:
            return
        if self.jsonl:
            self.jsonl.write(json.dumps({"iteration": iteration, split: losses}) + "\n")
            self.jsonl.flush()
        if self.tensorboard:
            for key, value in losses.items():
                self.tensorboard.add_scalar(f"{key} {split}", value, iteration)
                self.tensorboard.add_scalar(f"{key} {split} vs samples", value, consumed_samples)
                self.tensorboard.add_scalar(f"{key} {split} ppl", math.exp(min(20.0, value)), iteration)
        if self.wandb:
            values = {f"{key} {split}": value for key, value in losses.items()}
            values |= {f"{key} {split} ppl": math.exp(min(20.0, value)) for key, value in losses.items()}
            self.wandb.log(values, step=iteration)

    def close(self) -> None:
        if self.tensorboard:
            self.tensorboard.close()
        if self.jsonl:
            self.jsonl.close()
