"""``pretrain()``: Megatron-LM's training driver on megatron-core.

Order of work: arguments and tokenizer are checked before any process group
exists (a bad flag exits every rank at once, with one message); then process
groups, seeds, model chunks, DDP, optimizer and scheduler; then an optional
checkpoint load; then the loop of train steps with logging, evaluation and saves.
A failure after the process groups exist ends this rank at once with a message naming the
rank and iteration (start_errors.report_run_error / report_run_failure, then exit_now),
never a hang: torchrun stops the other ranks of the node, the collective timeout the others.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    get_num_microbatches,
    reconfigure_num_microbatches_calculator,
    update_num_microbatches,
)
from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from megatron_npu.accelerator import get_accelerator
from megatron_npu.data.dataset_check import check_dataset_tokenizer
from megatron_npu.data.tokenizers import TokenizerError, training_tokenizer
from megatron_npu.spec import uses_fused_attention
from megatron_npu.start_errors import exit_now, report_run_error, report_run_failure, report_start_error
from megatron_npu.training import checkpointing
from megatron_npu.training.arguments import ConfigError, parse_args
from megatron_npu.training.config import ddp_config, optimizer_config, params_dtype
from megatron_npu.training.data import (
    build_iterators,
    global_batch_size_at,
    total_iterations,
    train_valid_test_num_samples,
)
from megatron_npu.training.faults import FaultPlan, NonFiniteValue, check_forward_step, non_finite_grad
from megatron_npu.training.global_vars import print_rank_0, print_rank_last, set_global
from megatron_npu.training.initialize import initialize_distributed, set_random_seed, write_run_files
from megatron_npu.training.reporting import (
    MetricsWriter,
    finish_wandb,
    iteration_line,
    moe_losses,
    num_floating_point_operations,
    validation_lines,
)
from megatron_npu.training.timing import TimerLog, build_timers


def report_config_error(error: Exception) -> int:
    """One message whichever rank exits first, exit status 2 on every rank: no traceback, no hang."""
    return report_start_error(str(error))


def setup_args(
    argv: list[str] | None, args_defaults: dict | None, extra_args_provider: Callable | None = None
) -> tuple[argparse.Namespace, Any]:
    # Defaults and extra flags go in before validation, as Megatron-LM's initialize_megatron does.
    args = parse_args(argv, extra_args_provider=extra_args_provider, args_defaults=args_defaults)
    tokenizer, args.padded_vocab_size = training_tokenizer(args)
    check_dataset_tokenizer(args, tokenizer)  # a dataset from another tokenizer: one message, before any work
    if args.log_dir is None:
        args.log_dir = args.tensorboard_dir or (os.path.join(args.save, "logs") if args.save else None)
    return args, tokenizer


def _call_provider(model_provider: Callable, pre: bool, post: bool, vp_stage: int | None) -> torch.nn.Module:
    if "vp_stage" in inspect.signature(model_provider).parameters:
        return model_provider(pre_process=pre, post_process=post, vp_stage=vp_stage)
    return model_provider(pre_process=pre, post_process=post)


def build_model(model_provider: Callable, args: argparse.Namespace) -> list[DistributedDataParallel]:
    """One model chunk per virtual stage, on the device, wrapped in megatron-core DDP."""
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        if vp_stage is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(vp_stage)
        ignore_virtual = vp_stage is None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
        chunks.append(_call_provider(model_provider, pre, post, vp_stage))
    if vpp:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    device = get_accelerator().device()
    for chunk in chunks:
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        chunk.to(device)
    if args.fp16 or args.bf16:
        chunks = [Float16Module(chunk.config, chunk) for chunk in chunks]
    config = get_model_config(chunks[0])
    wrapped = [
        DistributedDataParallel(config=config, ddp_config=ddp_config(args), module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    if args.data_parallel_random_init:
        for chunk in wrapped:
            chunk.broadcast_params()
    return wrapped


def build_scheduler(optimizer: Any, args: argparse.Namespace) -> OptimizerParamScheduler:
    """Megatron-LM's scheduler arithmetic: steps count samples, not iterations."""
    if args.train_iters:
        decay_steps = (args.lr_decay_iters or args.train_iters) * args.global_batch_size
        wd_steps = args.train_iters * args.global_batch_size
        warmup_steps = args.lr_warmup_iters * args.global_batch_size
        wsd_steps = args.lr_wsd_decay_iters * args.global_batch_size if args.lr_wsd_decay_iters else None
    else:
        decay_steps = args.lr_decay_samples or args.train_samples
        wd_steps = args.train_samples
        warmup_steps = args.lr_warmup_samples
        wsd_steps = args.lr_wsd_decay_samples
    if args.lr_warmup_fraction is not None:
        warmup_steps = args.lr_warmup_fraction * decay_steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=wd_steps,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=wsd_steps,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def wire_model_config(model: list, optimizer: Any, timers: Any, args: argparse.Namespace) -> Any:
    """The hooks megatron-core's schedules call back into (as Megatron-LM sets them)."""
    config = get_model_config(model[0])
    config.timers = timers
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if args.overlap_grad_reduce:
        no_sync = [chunk.no_sync for chunk in model]
        config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
        if args.align_grad_reduce:
            grad_sync = [chunk.start_grad_sync for chunk in model]
            config.grad_sync_func = grad_sync[0] if len(model) == 1 else grad_sync
    if args.overlap_param_gather and args.align_param_gather:
        param_sync = [chunk.start_param_sync for chunk in model]
        config.param_sync_func = param_sync[0] if len(model) == 1 else param_sync
    return config


def learning_rates(optimizer: Any) -> tuple[float, float | None]:
    """The schedule's current lr and, with --decoupled-lr, the embedding/output layers' one
    (the groups get_standard_config_overrides() marks is_decoupled_lr, patches/optimizer.py), as Megatron-LM logs them."""
    default = decoupled = None
    for group in optimizer.param_groups:
        if not group["params"]:
            continue
        if group.get("is_decoupled_lr"):
            decoupled = group["lr"] if decoupled is None else decoupled
        elif default is None:
            default = group["lr"]
    return (default if default is not None else decoupled or 0.0), decoupled


def _mean_over_microbatches(reports: list[dict]) -> dict[str, torch.Tensor]:
    """Each reported value over the global batch (last stage only), as Megatron-LM reduces it:
    a [sum, count] pair is summed over micro-batches and DP ranks, then divided (a token
    mean); a scalar is averaged over micro-batches, then over DP ranks."""
    if not reports or not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    group = parallel_state.get_data_parallel_group()
    out = {}
    for key in reports[0]:
        values = [r[key].float().view(-1) for r in reports]
        if values[0].numel() == 2:
            total = torch.stack(values).sum(dim=0)
            dist.all_reduce(total, group=group)
            out[key] = total[0] / total[1].clamp(min=1)
        else:
            value = torch.cat(values).mean()
            dist.all_reduce(value, group=group)
            out[key] = value / parallel_state.get_data_parallel_world_size()
    return out


class Trainer:
    """State of one run: model chunks, optimizer, scheduler, iterators, counters."""

    def __init__(self, args: argparse.Namespace, model: list, optimizer: Any, scheduler: Any, forward_step: Callable):
        self.args = args
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.forward_step = forward_step
        if args.check_for_nan_in_loss_and_grad:
            self.forward_step = check_forward_step(forward_step, lambda: args.iteration)
        self.faults = FaultPlan.from_env()
        self.forward_backward = get_forward_backward_func()
        self.skipped_iterations = 0
        self.nan_iterations = 0
        self.exit_reason: str | None = None  # set when an exit condition ends train()

    def _iterator(self, iterators: list) -> Any:
        return iterators if len(self.model) > 1 else iterators[0]

    def _forward_backward(self, iterators: list, num_microbatches: int, *, forward_only: bool) -> list[dict]:
        """One pass of megatron-core's pipeline schedule over ``num_microbatches`` micro-batches."""
        return self.forward_backward(
            forward_step_func=self.forward_step,
            data_iterator=self._iterator(iterators),
            model=self.model,
            num_microbatches=num_microbatches,
            seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size,
            decoder_seq_length=self.args.seq_length,
            forward_only=forward_only,
        )

    def train_step(self, iterators: list) -> tuple[dict[str, torch.Tensor], bool, float | None, int | None]:
        args = self.args
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        try:
            reports = self._forward_backward(iterators, get_num_microbatches(), forward_only=False)
        except RuntimeError as error:
            grad_error = non_finite_grad(error, args.iteration)
            if grad_error is None:
                raise
            raise grad_error from error
        timers = self.model[0].config.timers
        timers("optimizer", log_level=1).start()
        updated, grad_norm, num_zeros = self.optimizer.step()
        timers("optimizer").stop()
        if updated:
            self.scheduler.step(increment=get_num_microbatches() * args.micro_batch_size * args.data_parallel_size)
        return _mean_over_microbatches(reports), updated, grad_norm, num_zeros

    def evaluate(self, iterators: list, count_validation_samples: bool = True) -> dict[str, float]:
        args = self.args
        for chunk in self.model:
            chunk.eval()
        totals: dict[str, float] = {}
        num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
        with torch.no_grad():
            for _ in range(args.eval_iters):
                reports = self._forward_backward(iterators, num_microbatches, forward_only=True)
                for key, value in _mean_over_microbatches(reports).items():
                    totals[key] = totals.get(key, 0.0) + value.item() / args.eval_iters
                if count_validation_samples:  # the resumable position of the validation stream
                    args.consumed_valid_samples += args.global_batch_size
        for chunk in self.model:
            chunk.train()
        return totals

    def save(self, iteration: int) -> None:
        if self.args.overlap_param_gather:  # saved weights must be the gathered, updated ones
            for chunk in self.model:
                chunk.disable_forward_pre_hook(param_sync=True)
        in_save = self.faults.fire_in_save if self.faults else None
        checkpointing.save_checkpoint(iteration, self.model, self.optimizer, self.scheduler, self.args, in_save)
        if self.args.overlap_param_gather:
            for chunk in self.model:
                chunk.enable_forward_pre_hook()


def _is_last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def _anywhere(iterators: list) -> bool:
    """True on every rank when any rank holds a data iterator."""
    return _sum_over_world(float(any(it is not None for it in iterators))) > 0


def _sum_over_world(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=get_accelerator().device())
    dist.all_reduce(tensor)
    return tensor.item()


def train(trainer: Trainer, iteration: int, train_iterators: list, valid_iterators: list | None) -> int:
    """The loop: steps, Megatron-LM log lines every --log-interval, evals, saves, exits."""
    args = trainer.args
    accelerator = get_accelerator()
    timers = trainer.model[0].config.timers
    timer_log = TimerLog(timers, args.log_dir, dist.get_rank(), args.timing_log_level)
    metrics = MetricsWriter(args, _is_last_rank())
    profiler = StepProfiler(args)
    peak = accelerator.peak_tflops(params_dtype(args))
    interval = {"time": 0.0, "iters": 0, "losses": {}, "flops": 0.0}
    start_time = time.time()
    train_iters = total_iterations(args)
    first_iteration = iteration
    saved = False
    exit_signal = ExitSignal(args.exit_signal_handler, args.exit_signal).install()
    while iteration < train_iters:
        iteration += 1
        args.iteration = iteration  # as Megatron-LM: what a failure's message names
        if trainer.faults:
            trainer.faults.fire(iteration, trainer.model)
        if args.step_batch_size_schedule:
            size = global_batch_size_at(args, iteration)
            if size != get_current_global_batch_size():
                print_rank_0(f"global batch size {get_current_global_batch_size()} -> {size} at iteration {iteration}")
                reconfigure_num_microbatches_calculator(
                    args.rank, None, size, args.micro_batch_size, args.data_parallel_size
                )
        else:
            update_num_microbatches(args.consumed_train_samples, consistency_check=True)
        batch_size = get_current_global_batch_size()
        profiler.before(iteration)
        accelerator.synchronize()
        started = time.perf_counter()
        losses, updated, grad_norm, num_zeros = trainer.train_step(train_iterators)
        accelerator.synchronize()
        elapsed = time.perf_counter() - started
        profiler.after(iteration)
        args.consumed_train_samples += batch_size
        trainer.skipped_iterations += 0 if updated else 1
        loss_values = {key: value.item() for key, value in losses.items()}
        if args.num_experts is not None:  # every rank: the tracker is reduced across ranks
            loss_values |= moe_losses(args, get_num_microbatches(), iteration, metrics.tensorboard)
        if any(not math.isfinite(v) for v in loss_values.values()):
            trainer.nan_iterations += 1
        flops = num_floating_point_operations(args, batch_size)
        lr, decoupled_lr = learning_rates(trainer.optimizer)
        loss_scale = trainer.optimizer.get_loss_scale().item()
        timer_log.write(
            iteration,
            elapsed,
            {
                "num_microbatches": get_num_microbatches(),
                "updated": updated,
                "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "dp_rank": parallel_state.get_data_parallel_rank(),
            },
        )
        throughput = flops / (elapsed * 1e12 * args.world_size)
        metrics.train(
            iteration,
            args.consumed_train_samples,
            {
                "lm_loss": loss_values.get("lm loss"),
                **{name: value for name, value in loss_values.items() if name != "lm loss"},
                "learning_rate": lr,
                "decoupled_learning_rate": decoupled_lr,
                "global_batch_size": batch_size,
                "loss_scale": loss_scale,
                "grad_norm": grad_norm,
                "iteration_s": elapsed,
                "throughput_tflops": throughput,
                "skipped_iterations": trainer.skipped_iterations,
                "nan_iterations": trainer.nan_iterations,
            },
        )
        interval["time"] += elapsed
        interval["iters"] += 1
        interval["flops"] += flops
        for key, value in loss_values.items():
            if math.isfinite(value):
                interval["losses"][key] = interval["losses"].get(key, 0.0) + value
        if iteration % args.log_interval == 0:
            per_iter = interval["time"] / interval["iters"]
            tflops = interval["flops"] / (interval["time"] * 1e12 * args.world_size)
            print_rank_last(
                iteration_line(
                    iteration=iteration,
                    train_iters=train_iters,
                    consumed_samples=args.consumed_train_samples,
                    elapsed_s=per_iter,
                    throughput_tflops=tflops if args.log_throughput else None,
                    mfu=tflops / peak if (peak and args.log_throughput) else None,
                    learning_rate=lr,
                    decoupled_learning_rate=decoupled_lr,
                    global_batch_size=batch_size,
                    losses={k: v / interval["iters"] for k, v in interval["losses"].items()},
                    loss_scale=loss_scale,
                    grad_norm=grad_norm,
                    num_zeros=num_zeros,
                    skipped=trainer.skipped_iterations,
                    nans=trainer.nan_iterations,
                )
            )
            interval = {"time": 0.0, "iters": 0, "losses": {}, "flops": 0.0}
        if valid_iterators is not None and args.eval_interval and iteration % args.eval_interval == 0:
            run_evaluation(trainer, valid_iterators, f"at iteration {iteration}", iteration, metrics)
        saved = bool(args.save and args.save_interval and iteration % args.save_interval == 0)
        if saved:
            trainer.save(iteration)
        timer_log.discard()
        trainer.exit_reason = _exit_reason(args, iteration, start_time, exit_signal)
        if trainer.exit_reason:
            print_rank_0(f"exiting program {trainer.exit_reason}")
            break
    if args.save and iteration > first_iteration and not saved:
        trainer.save(iteration)  # the last iteration is always on disk (Megatron-LM does the same)
    exit_signal.restore()
    timer_log.close()
    metrics.close()
    return iteration


class StepProfiler:
    """``--profile``: the accelerator's profiler (torch.profiler; torch_npu's on npu) over
    iterations [profile_step_start, profile_step_end) on ``--profile-ranks``; a Chrome trace
    per rank in LOG_DIR/profile/ (chrome://tracing, Perfetto)."""

    def __init__(self, args: argparse.Namespace):
        self.enabled = bool(args.profile) and dist.get_rank() in args.profile_ranks and args.log_dir is not None
        self.start, self.end = args.profile_step_start, args.profile_step_end
        self.path = os.path.join(args.log_dir or ".", "profile", f"rank{dist.get_rank():05d}.json")
        self._profiler: Any = None

    def before(self, iteration: int) -> None:
        if self.enabled and iteration == self.start:
            self._profiler = get_accelerator().profiler()
            self._profiler.__enter__()

    def after(self, iteration: int) -> None:
        if self._profiler is not None and iteration == self.end - 1:
            self._profiler.__exit__(None, None, None)
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._profiler.export_chrome_trace(self.path)
            self._profiler = None
            print_rank_0(f"  profiler trace of iterations {self.start}..{self.end - 1} written to {self.path}")


class ExitSignal:
    """``--exit-signal-handler``, as Megatron-LM's DistributedSignalHandler: SIGTERM (a
    scheduler preempting the job, or torchrun forwarding its own) only sets a flag; after
    each iteration the flags are summed over the world, so every rank saves the same
    iteration and stops. torchrun sends SIGKILL 30 s after it forwards SIGTERM: the
    iteration in flight and the save must fit in that."""

    def __init__(self, enabled: bool, signum: int = signal.SIGTERM) -> None:
        self.enabled, self.signum, self.received = enabled, signum, False
        self._previous: Any = None

    def install(self) -> ExitSignal:
        if self.enabled:
            self._previous = signal.signal(self.signum, self._handle)
        return self

    def restore(self) -> None:
        if self.enabled:
            signal.signal(self.signum, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True

    def any_rank_received(self) -> bool:
        return self.enabled and _sum_over_world(float(self.received)) > 0


def _exit_reason(args: argparse.Namespace, iteration: int, start_time: float, exit_signal: ExitSignal) -> str | None:
    """Megatron-LM's exit conditions, decided alike on every rank (None: go on)."""
    if exit_signal.any_rank_received():
        return f"after receiving {signal.Signals(exit_signal.signum).name} at iteration {iteration}"
    if args.exit_interval and iteration % args.exit_interval == 0:
        return f"at iteration {iteration} (--exit-interval {args.exit_interval})"
    if args.exit_duration_in_mins:
        over = (time.time() - start_time) / 60.0 > args.exit_duration_in_mins
        if _sum_over_world(float(over)) > 0:  # every rank stops at the same iteration
            return f"after {args.exit_duration_in_mins} minutes at iteration {iteration} (--exit-duration-in-mins)"
    return None


def run_evaluation(
    trainer: Trainer, iterators: list, prefix: str, iteration: int, metrics: MetricsWriter, split: str = "validation"
) -> None:
    losses = trainer.evaluate(iterators, count_validation_samples=split == "validation")
    print_rank_last(validation_lines(prefix, losses))
    metrics.evaluation(iteration, trainer.args.consumed_train_samples, losses, split)


def pretrain(
    train_valid_test_dataset_provider: Callable,
    model_provider: Callable,
    model_type: Any,
    forward_step_func: Callable,
    process_non_loss_data_func: Callable | None = None,
    extra_args_provider: Callable | None = None,
    args_defaults: dict | None = None,
    argv: list[str] | None = None,
) -> int:
    """Megatron-LM's ``pretrain()`` signature; returns the process exit status."""
    del model_type, process_non_loss_data_func  # GPT only; kept for signature parity
    try:
        args, tokenizer = setup_args(argv, args_defaults, extra_args_provider)
    except (ConfigError, TokenizerError) as error:
        return report_config_error(error)
    set_global("args", args)
    set_global("tokenizer", tokenizer)
    for flag, reason in args.ignored_flags:
        print_rank_0(f"WARNING: {flag} is ignored: {reason}")
    for warning in args.config_warnings:
        print_rank_0(f"WARNING: {warning}")
    if args.use_flash_attn and not uses_fused_attention(args):
        print_rank_0(
            "WARNING: --use-flash-attn: this device has no fused attention kernel; "
            "megatron-core's unfused attention runs"
        )

    initialize_distributed(args)
    args.iteration = 0
    try:
        return _run(args, model_provider, forward_step_func, train_valid_test_dataset_provider)
    except NonFiniteValue as error:  # this rank found the NaN or Inf: it is the origin
        exit_now(report_run_error(str(error)))
    except Exception as error:
        stage = f"at iteration {args.iteration}" if args.iteration else "before training"
        exit_now(report_run_failure(error, f"rank {dist.get_rank()} failed {stage}"))


def _run(
    args: argparse.Namespace,
    model_provider: Callable,
    forward_step_func: Callable,
    train_valid_test_dataset_provider: Callable,
) -> int:
    """Everything after the process groups exist; returns the exit status."""
    set_random_seed(args.seed, args.data_parallel_random_init)
    timers = build_timers(args.timing_log_level, args.timing_log_option)
    set_global("timers", timers)
    write_run_files(args)

    model = build_model(model_provider, args)
    opt_config = optimizer_config(args)
    # The standard overrides, with the decoupled group marked is_decoupled_lr (patches/optimizer.py).
    overrides = get_standard_config_overrides(config=opt_config)
    optimizer = get_megatron_optimizer(opt_config, model, config_overrides=overrides)
    scheduler = build_scheduler(optimizer, args)
    wire_model_config(model, optimizer, timers, args)
    iteration = 0
    if args.save:
        checkpointing.clean_unfinished_saves(args.save)
    try:
        if args.load:
            iteration = checkpointing.load_checkpoint(model, optimizer, scheduler, args)
    except ConfigError as error:
        return report_config_error(error)
    trainer = Trainer(args, model, optimizer, scheduler, forward_step_func)

    datasets = train_valid_test_dataset_provider(train_valid_test_num_samples(args))
    train_iterators, valid_iterators, test_iterators = build_iterators(datasets, len(model), args)
    # Every rank evaluates or none does: ranks whose chunks read no data hold None
    # iterators but still take part in the pipeline.
    has_validation = args.eval_iters > 0 and _anywhere(valid_iterators)
    has_test = args.eval_iters > 0 and _anywhere(test_iterators)
    print_rank_0(
        f"training: {sum(p.numel() for p in model[0].parameters())} parameters on rank 0, "
        f"{args.world_size} ranks = TP {args.tensor_model_parallel_size} x PP "
        f"{args.pipeline_model_parallel_size} x DP {args.data_parallel_size}"
    )
    if not args.skip_train:
        iteration = train(trainer, iteration, train_iterators, valid_iterators if has_validation else None)
    final_metrics = MetricsWriter(args, _is_last_rank())
    if trainer.exit_reason:  # as Megatron-LM: an exit condition ends the job once the checkpoint is saved
        return _teardown()
    if has_validation and not args.skip_train:
        run_evaluation(
            trainer, valid_iterators, f"at iteration {iteration} on validation set", iteration, final_metrics
        )
    if has_test:  # Megatron-LM evaluates the test split once, at the end
        run_evaluation(
            trainer, test_iterators, f"at iteration {iteration} on test set", iteration, final_metrics, split="test"
        )
    final_metrics.close()
    return _teardown()


def _teardown() -> int:
    """The end of every run: the wandb record closed, all ranks past the barrier, groups gone."""
    finish_wandb()
    dist.barrier()
    dist.destroy_process_group()
    return 0
