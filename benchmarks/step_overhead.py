"""Per-iteration overhead of pretrain_gpt.py's loop against a plain-PyTorch loop of the same math.

    python benchmarks/step_overhead.py [--iters 40] [--warmup 3] [--threads 1]

One process on the cpu target (a 1-rank gloo group, no torchrun). Both sides train the
same megatron-core GPTModel (pretrain_gpt.py's model_provider, weights copied from the
trainer's model, dropout off) on the same pre-generated micro-batches:

  trainer  the body of Trainer.train's loop, one iteration at a time: Trainer.train_one_step
           (batch-size schedule, TrainStep = megatron-core's forward_backward_func + DDP grad
           buffers + megatron optimizer with grad clipping + OptimizerParamScheduler, the step's
           StepRecord) and TrainingMetrics' write / end_of_iteration, with pretrain_gpt.py's
           forward_step (evaluation and saving are off in this run, as their steps never fire);
  plain    a hand-written loop: per micro-batch forward, masked mean loss / num_microbatches,
           backward; clip_grad_norm_(1.0); torch.optim.AdamW (same lr, betas, eps, weight
           decay, and megatron's no-decay rule for biases and 1-D params); zero grads.

Data loading is excluded from both: every micro-batch is built in memory before timing
(the trainer's forward_step still calls get_batch, whose .to(device) is a no-op on cpu).
Iterations are interleaved (trainer, plain, plain, trainer, ...) so drift from other
load on the machine hits both alike; medians are reported. The losses of both runs are
compared step by step: the same math must give the same losses (exit status 1 otherwise).
The ratio is measured within this one run; never used as a timed test.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

os.environ["MEGATRON_NPU_DEVICE"] = os.environ.get("MEGATRON_NPU_DEVICE", "cpu")  # before megatron_npu

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = 1.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _megatron_flags(a: argparse.Namespace, total_iters: int) -> list[str]:
    return [
        "--num-layers",
        str(a.layers),
        "--hidden-size",
        str(a.hidden),
        "--num-attention-heads",
        str(a.heads),
        "--seq-length",
        str(a.seq),
        "--max-position-embeddings",
        str(a.seq),
        "--micro-batch-size",
        str(a.mbs),
        "--global-batch-size",
        str(a.gbs),
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(a.vocab),
        "--train-iters",
        str(total_iters),
        "--lr",
        "1e-3",
        "--min-lr",
        "1e-3",
        "--lr-decay-style",
        "constant",
        "--weight-decay",
        "0.01",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--adam-eps",
        "1e-8",
        "--clip-grad",
        "1.0",
        "--seed",
        "1234",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--log-interval",
        str(10 * total_iters + 1),
        "--eval-iters",
        "0",
        "--num-workers",
        "0",
    ]


def _batches(a: argparse.Namespace, steps: int, device) -> list[list[dict]]:
    """steps x num_microbatches micro-batches in pretrain_gpt.get_batch's format."""
    import torch

    g = torch.Generator().manual_seed(0)
    num_mb = a.gbs // a.mbs
    positions = torch.arange(a.seq).unsqueeze(0).expand(a.mbs, -1).contiguous()
    out = []
    for _ in range(steps):
        step = []
        for _ in range(num_mb):
            text = torch.randint(0, a.vocab, (a.mbs, a.seq + 1), generator=g)
            mask = (torch.rand(a.mbs, a.seq, generator=g) > 0.05).float()  # a few masked tokens
            step.append(
                {
                    "tokens": text[:, :-1].contiguous().to(device),
                    "labels": text[:, 1:].contiguous().to(device),
                    "loss_mask": mask.to(device),
                    "position_ids": positions.to(device),
                }
            )
        out.append(step)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=40, help="timed iterations of each loop")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations of each loop first")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--gbs", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1000)
    a = p.parse_args(argv)
    total = a.warmup + a.iters

    t_import = time.perf_counter()
    import torch
    import torch.distributed as dist
    from megatron.core.optimizer import get_megatron_optimizer

    import megatron_npu  # noqa: F401  (patches megatron-core for the target first)
    import pretrain_gpt
    from megatron_npu.accelerator import get_accelerator
    from megatron_npu.training import global_vars
    from megatron_npu.training.builders import build_model, build_scheduler, wire_model_config
    from megatron_npu.training.config import optimizer_config
    from megatron_npu.training.initialize import initialize_distributed, set_random_seed
    from megatron_npu.training.loop import setup_args
    from megatron_npu.training.run_state import RunState
    from megatron_npu.training.timing import build_timers
    from megatron_npu.training.trainer import Trainer

    torch.set_num_threads(a.threads)
    accelerator = get_accelerator()
    print(
        f"imports {time.perf_counter() - t_import:.1f} s; target {accelerator.device_type}, {a.threads} thread(s)",
        flush=True,
    )

    # ---- the trainer, assembled as loop.pretrain() does --------------------------------
    args, tokenizer = setup_args(_megatron_flags(a, total), None)
    global_vars.set_global("args", args)
    global_vars.set_global("tokenizer", tokenizer)
    dist.init_process_group(
        accelerator.communication_backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    initialize_distributed(args.distributed, args.parallel, args.schedule)
    set_random_seed(args.seed, args.data_parallel_random_init)
    timers = build_timers(args.timing_log_level, args.timing_log_option)
    global_vars.set_global("timers", timers)
    model = build_model(
        pretrain_gpt.model_provider,
        args.parallel,
        args.precision,
        args.distributed,
        args.training,
        args.fsdp,
        args.init,
    )
    optimizer = get_megatron_optimizer(
        optimizer_config(args.optim, args.schedule, args.precision, args.distributed, args.logging), model
    )
    scheduler = build_scheduler(optimizer, args.schedule)
    wire_model_config(model, optimizer, timers, args.distributed)
    state = RunState()
    trainer = Trainer(args, state, model, optimizer, scheduler, pretrain_gpt.forward_step, timers)
    metrics = trainer.training_metrics()

    # ---- the plain model: same provider, same weights ---------------------------------
    device = accelerator.device()
    plain = pretrain_gpt.model_provider().to(device)
    plain.load_state_dict(model[0].module.state_dict(), strict=True)
    plain.train()
    names = dict(plain.named_parameters())
    params = list(names.values())
    no_decay = [p for n, p in names.items() if p.ndim == 1 or n.endswith(".bias")]  # megatron's wd skip rule
    decay = [p for n, p in names.items() if not (p.ndim == 1 or n.endswith(".bias"))]
    plain_opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
    )
    groups = {(g["lr"], g["weight_decay"], sum(p.numel() for p in g["params"])) for g in optimizer.param_groups}
    mine = {(g["lr"], g["weight_decay"], sum(p.numel() for p in g["params"])) for g in plain_opt.param_groups}
    if groups != mine:
        print(f"error: optimizer groups differ: trainer {sorted(groups)} plain {sorted(mine)}")
        return 1

    num_mb = a.gbs // a.mbs
    data = _batches(a, total, device)
    n_params = sum(p.numel() for p in params)
    print(
        f"GPT {a.layers} layers, hidden {a.hidden}, {a.heads} heads, seq {a.seq}, vocab {args.padded_vocab_size}: "
        f"{n_params / 1e6:.2f} M parameters; {num_mb} micro-batches of {a.mbs} per step",
        flush=True,
    )

    # ---- one iteration of each loop ----------------------------------------------------
    trainer_losses: list[float] = []
    step_times: list[float] = []
    inner_step = trainer.step

    def recorded_step(iterators):  # what train_one_step calls: record its loss and time, nothing else
        started = time.perf_counter()
        result = inner_step(iterators)
        step_times.append(time.perf_counter() - started)
        trainer_losses.append(result.losses["lm loss"].item())
        return result

    trainer.step = recorded_step

    def trainer_iteration(k: int) -> float:
        accelerator.synchronize()
        started = time.perf_counter()
        state.iteration += 1  # Trainer.train's loop body, evaluation and saving being off
        metrics.write(trainer.train_one_step([iter(data[k])], metrics))
        metrics.end_of_iteration()
        accelerator.synchronize()
        return time.perf_counter() - started

    plain_losses: list[float] = []

    def plain_iteration(k: int) -> float:
        accelerator.synchronize()
        started = time.perf_counter()
        total_loss = torch.zeros((), device=device)
        for mb in data[k]:
            output = plain(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])
            mask = mb["loss_mask"].view(-1).float()
            loss = torch.sum(output.float().view(-1) * mask) / mask.sum()
            (loss / num_mb).backward()
            total_loss += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        plain_losses.append((total_loss / num_mb).item())
        accelerator.synchronize()
        return time.perf_counter() - started

    t_run = time.perf_counter()
    times: dict[str, list[float]] = {"trainer": [], "plain": []}
    for k in range(total):
        order = [("trainer", trainer_iteration), ("plain", plain_iteration)]
        for name, fn in order if k % 2 == 0 else reversed(order):  # ABBA: neither always goes first
            elapsed = fn(k)
            if k >= a.warmup:
                times[name].append(elapsed)
    run_s = time.perf_counter() - t_run

    # ---- report ------------------------------------------------------------------------
    med = {name: statistics.median(values) for name, values in times.items()}
    med["trainer step"] = statistics.median(step_times[a.warmup :])
    ratio = med["trainer"] / med["plain"]
    step_ratio = med["trainer step"] / med["plain"]
    diffs = [abs(x - y) for x, y in zip(trainer_losses, plain_losses, strict=True)]
    rel = max(d / abs(y) for d, y in zip(diffs, plain_losses, strict=True))
    print(f"\n{a.iters} timed iterations each (after {a.warmup} warm-up), interleaved; {run_s:.1f} s in all")
    print(f"{'loop':<22}{'median ms':>10}{'min ms':>9}{'max ms':>9}")
    for name, values in (
        ("trainer", times["trainer"]),
        ("trainer step", step_times[a.warmup :]),
        ("plain", times["plain"]),
    ):
        print(f"{name:<22}{1e3 * med[name]:>10.1f}{1e3 * min(values):>9.1f}{1e3 * max(values):>9.1f}")
    print(
        f"\nloss after {total} steps: trainer {trainer_losses[-1]:.6f}  plain {plain_losses[-1]:.6f}  "
        f"(first {trainer_losses[0]:.6f}); max |diff| over all steps {max(diffs):.2e} (relative {rel:.2e})"
    )
    print(
        f"ratio trainer/plain (loop iteration): {ratio:.3f}   target <= {TARGET}: {'yes' if ratio <= TARGET else 'NO'}"
    )
    print(f"ratio trainer/plain (TrainStep only): {step_ratio:.3f}")
    # The fastest iterations are the least disturbed by other load on a shared machine.
    print(f"ratio of the fastest iterations: {min(times['trainer']) / min(times['plain']):.3f}")
    same_math = rel < 1e-3
    if not same_math:
        print("error: the two loops' losses differ: the comparison is not of the same math")
    metrics.close()
    dist.destroy_process_group()
    return 0 if same_math else 1


if __name__ == "__main__":
    sys.exit(main())
