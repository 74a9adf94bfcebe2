"""Megatron-LM flags this trainer refuses (with the reason and the alternative) or ignores.

A refused flag stops the run before anything starts, with one message naming the
flag, why it cannot apply on Ascend or in this trainer, and what to use instead.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A bad configuration; the message names the flags to change."""


# ---------------------------------------------------------------------------------------
# Refused and ignored flags
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """A Megatron-LM flag this trainer refuses.

    ``flag`` is an option string or an fnmatch pattern (``--moe-*``). ``allowed`` lists the
    values that are still accepted (e.g. ``--ckpt-format torch_dist``); ``None`` means the
    flag is refused whenever it is given.
    """

    flag: str
    reason: str
    alternative: str
    allowed: tuple[str, ...] | None = None

    def message(self, given: str | None = None, value: Any = None) -> str:
        what = given or self.flag
        if self.allowed is not None and value is not None:
            what = f"{what} {_value_str(value)}"
        return f"{what} is not supported: {self.reason}; {self.alternative}"


_TE = "Transformer Engine is CUDA-only"
_FP8 = "Ascend 910B has no fp8/fp4 compute"
_MOE = "MoE is not supported by this trainer yet"
_DROP = "drop the flag"

# Exact rows before patterns: refusal_for() returns the first match.
REFUSED: tuple[Refusal, ...] = (
    Refusal("--transformer-impl", _TE,
            "use --transformer-impl local (the default; `megatron-npu migrate` rewrites it)", ("local",)),
    Refusal("--ckpt-format", "only the torch_dist distributed checkpoint format is supported",
            "use --ckpt-format torch_dist (the default)", ("torch_dist",)),
    Refusal("--context-parallel-size", "context parallelism is not supported by this trainer yet",
            "use --context-parallel-size 1 (the default)", ("1",)),
    Refusal("--cp-comm-type", "context parallelism is not supported by this trainer yet", _DROP, ("p2p",)),
    Refusal("--hierarchical-context-parallel-sizes", "context parallelism is not supported by this trainer yet",
            _DROP),
    Refusal("--expert-model-parallel-size", _MOE, "use --expert-model-parallel-size 1 (the default)", ("1",)),
    Refusal("--expert-tensor-parallel-size", _MOE, _DROP),
    Refusal("--num-experts", _MOE, "drop --num-experts (dense model)", ("0", "None")),
    Refusal("--moe-*", _MOE, _DROP),
    Refusal("--cuda-graph-impl", "CUDA graphs are CUDA-only", _DROP, ("none",)),
    Refusal("--enable-cuda-graph", "CUDA graphs are CUDA-only", _DROP),
    Refusal("--external-cuda-graph", "CUDA graphs are CUDA-only", _DROP),
    Refusal("--cuda-graph-*", "CUDA graphs are CUDA-only", _DROP),
    Refusal("--te-rng-tracker", _TE, _DROP),
    Refusal("--tp-comm-*", f"TP communication/GEMM overlap uses TE userbuffers ({_TE})", _DROP),
    Refusal("--disable-tp-comm-*", f"TP communication/GEMM overlap uses TE userbuffers ({_TE})", _DROP),
    Refusal("--fp8*", _FP8, "use --bf16"),
    Refusal("--no-fp8*", _FP8, "use --bf16"),
    Refusal("--fp4*", _FP8, "use --bf16"),
    Refusal("--first-last-layers-bf16", _FP8, "use --bf16"),
    Refusal("--use-torch-fsdp2", "FSDP is not supported by this trainer",
            "use --use-distributed-optimizer (shards optimizer state across data-parallel ranks)"),
    Refusal("--use-custom-fsdp", "FSDP is not supported by this trainer",
            "use --use-distributed-optimizer (shards optimizer state across data-parallel ranks)"),
    Refusal("--use-megatron-fsdp", "FSDP is not supported by this trainer",
            "use --use-distributed-optimizer (shards optimizer state across data-parallel ranks)"),
    Refusal("--async-save", "asynchronous checkpoint saving is not supported yet", "drop it (saves are synchronous)"),
    Refusal("--use-tp-pp-dp-mapping", "rank maps, rank tables and checks assume megatron-core's default order",
            "drop it (the order is tp-cp-ep-dp-pp)"),
    Refusal("--pretrained-checkpoint", "loading from a second checkpoint root is not supported",
            "use --load DIR --finetune"),
    Refusal("--iterations-to-skip", "skipping chosen iterations is not supported", _DROP),
    Refusal("--dataloader-type", "an external data loader needs code this trainer does not have",
            "use --dataloader-type single (the default) or cyclic", ("single", "cyclic")),
    Refusal("--apply-layernorm-1p", "zero-centered-gamma norms need Transformer Engine", _DROP),
    Refusal("--num-distributed-optimizer-instances", "one distributed-optimizer instance per DP group only",
            "use --num-distributed-optimizer-instances 1 (the default)", ("1",)),
    Refusal("--use-legacy-models", "legacy (non-megatron-core) models are gone; megatron-core models are always used",
            _DROP),
    Refusal("--multi-latent-attention", "multi-latent attention is not supported by this trainer", _DROP),
    Refusal("--mtp-num-layers", "multi-token prediction is not supported by this trainer", _DROP),
    Refusal("--decoder-first-pipeline-num-layers", "uneven pipeline stages are not supported by this trainer",
            "make --num-layers divisible by --pipeline-model-parallel-size"),
    Refusal("--decoder-last-pipeline-num-layers", "uneven pipeline stages are not supported by this trainer",
            "make --num-layers divisible by --pipeline-model-parallel-size"),
    Refusal("--pipeline-model-parallel-layout", "custom pipeline layouts are not supported by this trainer",
            "use --num-layers-per-virtual-pipeline-stage for interleaving"),
    Refusal("--account-for-embedding-in-pipeline-split", "uneven pipeline stages are not supported by this trainer",
            _DROP),
    Refusal("--account-for-loss-in-pipeline-split", "uneven pipeline stages are not supported by this trainer",
            _DROP),
    Refusal("--overlap-param-gather-with-optimizer-step",
            "Megatron-LM does not support it with distributed checkpointing (always on here)", _DROP),
)

# Accepted for compatibility, no effect in this trainer: recorded in args.ignored_flags
# (flag, reason) when given, for the trainer to print once.
IGNORED: dict[str, str] = {
    "--use-mcore-models": "megatron-core models are always used",
    "--no-async-tensor-model-parallel-allreduce": "deprecated in Megatron-LM; no effect",
    "--use-dist-ckpt": "deprecated in Megatron-LM; --ckpt-format torch_dist is always distributed",
    "--dist-ckpt-format": "deprecated in Megatron-LM; see --ckpt-format",
    "--ckpt-fully-parallel-save": "deprecated in Megatron-LM; fully parallel save is the default",
    "--no-persist-layer-norm": "there is no persistent layer-norm kernel on this target",
    "--manual-gc": "the trainer keeps Python's default garbage collector",
    "--manual-gc-interval": "the trainer keeps Python's default garbage collector",
    "--no-manual-gc-eval": "the trainer keeps Python's default garbage collector",
    "--attention-backend": "the local transformer implementation picks the attention kernel for the device",
    "--use-checkpoint-args": "model arguments are not read back from the checkpoint; pass them on the command line",
    "--use-mp-args-from-checkpoint-args": "parallel sizes are not read back from the checkpoint",
    "--tiktoken-pattern": "TikTokenizer is not supported; the flag only applies to it",
    "--no-create-attention-mask-in-dataloader": "the causal mask is built by the attention kernel",
    "--empty-unused-memory-level": "the device allocator cache is not emptied per iteration",
    "--log-energy": "energy counters are CUDA-only",
    "--log-params-norm": "the parameter norm is not computed; the grad norm is logged",
    "--log-timers-to-tensorboard": "timers go to LOG_DIR/timers/*.jsonl (--timing-log-level 1), not TensorBoard",
    "--log-memory-to-tensorboard": "memory is not logged to TensorBoard",
    "--log-world-size-to-tensorboard": "the world size is in LOG_DIR/args.json",
    "--log-validation-ppl-to-tensorboard": "validation perplexity is always written to TensorBoard",
    "--no-log-loss-scale-to-tensorboard": "the loss scale is always written to TensorBoard",
    "--check-for-spiky-loss": "the rerun state machine's spiky-loss check is not wired",
    "--check-for-large-grads": "the rerun state machine's large-gradient check is not wired",
    "--save-retain-interval": "every saved checkpoint is kept",
    "--record-memory-history": "no allocator history is recorded",
    "--memory-snapshot-path": "no allocator history is recorded",
    "--ckpt-fully-parallel-load": "loads use megatron-core's default strategy",
    "--ckpt-assume-constant-structure": "each save builds its plan afresh",
    "--log-progress": "progress is the iteration line and LOG_DIR/metrics.jsonl",
    "--logging-level": "the trainer prints on rank 0 / the last rank only",
    "--no-barrier-with-level-1-timing": "per-rank timers never barrier: each rank's own waits are what they show",
    "--train-sync-interval": "the host synchronises with the device once per iteration (for the timers)",
    "--check-weight-hash-across-dp-replicas-interval": "DP replicas are not hashed",
    "--ddp-num-buckets": "use --ddp-bucket-size",
    "--ddp-pad-buckets-for-high-nccl-busbw": "an NCCL bus-bandwidth tuning; not applied",
}


def _value_str(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def refusal_for(flag: str) -> Refusal | None:
    """The REFUSED row that covers an option string (``--x`` or ``--x=v``), or None."""
    name = flag.split("=", 1)[0]
    for row in REFUSED:
        if name == row.flag:
            return row
    for row in REFUSED:
        if any(c in row.flag for c in "*?[") and fnmatch.fnmatchcase(name, row.flag):
            return row
    return None
