"""``pretrain()``: Megatron-LM's training driver on megatron-core.

Order of work: arguments and tokenizer are checked before any process group exists (a bad flag
exits every rank at once, with one message) and the settings are frozen; then process groups,
seeds, model chunks, DDP, optimizer and scheduler (builders.py); then an optional checkpoint load;
then the trainer's loop (trainer.py) and the final evaluations. A failure after the process groups
exist ends this rank at once with a message naming the rank and iteration
(start_errors.report_run_error / report_run_failure, then exit_now), never a hang: torchrun stops
the other ranks of the node, the collective timeout the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from megatron_npu.data.dataset_check import check_dataset_tokenizer
from megatron_npu.data.tokenizers import TokenizerError, training_tokenizer
from megatron_npu.spec import uses_fused_attention
from megatron_npu.start_errors import exit_now, report_run_error, report_run_failure, report_start_error
from megatron_npu.training.arguments import ConfigError, parse_args
from megatron_npu.training.builders import build_model, build_optimizer, build_scheduler, wire_model_config
from megatron_npu.training.data import build_iterators, train_valid_test_num_samples
from megatron_npu.training.evaluation import Validator
from megatron_npu.training.exit_policy import sum_over_world
from megatron_npu.training.faults import NonFiniteValue
from megatron_npu.training.global_vars import print_rank_0, set_global
from megatron_npu.training.initialize import initialize_distributed, set_random_seed, write_run_files
from megatron_npu.training.reporting import MetricsWriter, finish_wandb
from megatron_npu.training.run_state import RunState
from megatron_npu.training.settings import Settings
from megatron_npu.training.timing import build_timers
from megatron_npu.training.trainer import Trainer


def report_config_error(error: Exception) -> int:
    """One message whichever rank exits first, exit status 2 on every rank: no traceback, no hang."""
    return report_start_error(str(error))


def setup_args(
    argv: list[str] | None, args_defaults: dict | None, extra_args_provider: Callable | None = None
) -> tuple[Settings, Any]:
    """The settings, validated and frozen, and the tokenizer: all before any process group exists."""
    # Defaults and extra flags go in before validation, as Megatron-LM's initialize_megatron does.
    args = parse_args(argv, extra_args_provider=extra_args_provider, args_defaults=args_defaults)
    tokenizer, args.padded_vocab_size = training_tokenizer(
        args.tokenizer, args.model.make_vocab_size_divisible_by, args.parallel.tp
    )
    check_dataset_tokenizer(args, tokenizer)  # a dataset from another tokenizer: one message, before any work
    return args.freeze(), tokenizer


def print_start_warnings(args: Settings) -> None:
    for flag, reason in args.ignored_flags:
        print_rank_0(f"WARNING: {flag} is ignored: {reason}")
    for warning in args.config_warnings:
        print_rank_0(f"WARNING: {warning}")
    if args.use_flash_attn and not uses_fused_attention(args):
        print_rank_0(
            "WARNING: --use-flash-attn: this device has no fused attention kernel; "
            "megatron-core's unfused attention runs"
        )


def _anywhere(iterators: list) -> bool:
    """True on every rank when any rank holds a data iterator."""
    return sum_over_world(float(any(it is not None for it in iterators))) > 0


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
    print_start_warnings(args)
    initialize_distributed(args.distributed, args.parallel, args.schedule)
    state = RunState()
    try:
        return _run(args, state, model_provider, forward_step_func, train_valid_test_dataset_provider)
    except NonFiniteValue as error:  # this rank found the NaN or Inf: it is the origin
        exit_now(report_run_error(str(error)))
    except Exception as error:
        stage = f"at iteration {state.iteration}" if state.iteration else "before training"
        exit_now(report_run_failure(error, f"rank {dist.get_rank()} failed {stage}"))


def _run(
    args: Settings,
    state: RunState,
    model_provider: Callable,
    forward_step_func: Callable,
    train_valid_test_dataset_provider: Callable,
) -> int:
    """Everything after the process groups exist, each part built from its own sections; returns the exit status."""
    set_random_seed(args.init.seed, args.init.data_parallel_random_init)
    timers = build_timers(args.logging.timing_log_level, args.logging.timing_log_option)
    set_global("timers", timers)
    write_run_files(args.logging.log_dir, args.values())  # args.json: every flag's value, as Megatron-LM names it
    model = build_model(
        model_provider, args.parallel, args.precision, args.distributed, args.training, args.fsdp, args.init
    )
    optimizer = build_optimizer(model, args.optim, args.schedule, args.precision, args.distributed, args.logging)
    scheduler = build_scheduler(optimizer, args.schedule)
    wire_model_config(model, optimizer, timers, args.distributed)
    trainer = Trainer(args, state, model, optimizer, scheduler, forward_step_func, timers)
    trainer.checkpointer.clean_unfinished()
    try:
        trainer.checkpointer.load()
    except ConfigError as error:
        return report_config_error(error)

    schedule, dims = args.schedule, args.parallel
    datasets = train_valid_test_dataset_provider(train_valid_test_num_samples(schedule))
    train_iterators, valid_iterators, test_iterators = build_iterators(
        datasets, len(model), state, data=args.data, schedule=schedule, seed=args.init.seed, dp=dims.dp
    )
    # Every rank evaluates or none does: ranks whose chunks read no data hold None
    # iterators but still take part in the pipeline.
    has_validation = schedule.eval_iters > 0 and _anywhere(valid_iterators)
    has_test = schedule.eval_iters > 0 and _anywhere(test_iterators)
    print_rank_0(
        f"training: {sum(p.numel() for p in model[0].parameters())} parameters on rank 0, "
        f"{dims.world_size} ranks = TP {dims.tp} x PP {dims.pp} x DP {dims.dp}"
    )
    if not schedule.skip_train:
        trainer.train(train_iterators, valid_iterators if has_validation else None)
    if state.exit_reason:  # as Megatron-LM: an exit condition ends the job once the checkpoint is saved
        return _teardown()
    final_evaluation(
        trainer.validator,
        valid_iterators if has_validation and not schedule.skip_train else None,
        test_iterators if has_test else None,
        trainer.new_writer(),
    )
    return _teardown()


def final_evaluation(
    validator: Validator, valid_iterators: list | None, test_iterators: list | None, metrics: MetricsWriter
) -> None:
    """After training: the validation split once more, and the test split once (as Megatron-LM), into
    ``metrics`` (closed at the end)."""
    iteration = validator.state.iteration
    if valid_iterators is not None:
        validator.run(valid_iterators, f"at iteration {iteration} on validation set", metrics)
    if test_iterators is not None:
        validator.run(test_iterators, f"at iteration {iteration} on test set", metrics, split="test")
    metrics.close()


def _teardown() -> int:
    """The end of every run: the wandb record closed, all ranks past the barrier, groups gone."""
    finish_wandb()
    dist.barrier()
    dist.destroy_process_group()
    return 0
