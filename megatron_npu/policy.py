"""What this project does with Megatron-LM's flags and CUDA/NCCL settings: one table.

Read by the trainer's argument checks (``training/arguments.py``), ``megatron-npu migrate``
(``migrate/rules.py``), the doctor and the patches for upstream Megatron-LM's trainer, so
that a flag is refused, ignored or mapped with the same words everywhere. Pure Python: no
torch or megatron import (the migration tool runs on machines without either).

Flags (``FLAG_POLICY``, one ``FlagPolicy`` per flag or ``--prefix*`` pattern):
  refused  the trainer stops with ``message()``: the flag, why, and what to use instead.
           ``allowed`` lists values still accepted (``--ckpt-format torch_dist``).
  ignored  accepted for compatibility, no effect; the trainer prints the reason once.
  mapped   honoured, by something else on Ascend (``--distributed-backend nccl`` runs as
           the accelerator's backend, ``--use-flash-attn`` as the fused kernel).

``migrate`` says what ``megatron-npu migrate`` does with a script that gives the flag:
  drop     remove it (with its value when ``takes_value``): an optimisation that only
           exists on CUDA, the model's math is the same without it
  ask      refuse the migration unless --force, which drops it (the math would change: fp8)
  rewrite  replace the value ``rewrite`` names (``"old=new"``)
  replace  replace the flag and its value by the flag ``rewrite`` names, for the values in ``allowed``
  note     keep it, with a note saying what runs on Ascend
  ""       copy it; migrate's flag check then reports the trainer's outcome

Environment (``ENV_POLICY``): CUDA/NCCL variables and their Ascend counterparts.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Literal

# The row type and the error live in fates.py (the sections' fields carry rows too); re-exported here.
from .fates import (
    CUDA_GRAPH,
    DEEPEP,
    DROP,
    FALSE,
    NO_HISTORY,
    TE,
    TRUE,
    Accepted,
    ConfigError,
    FlagPolicy,
    MigrateAction,
    Outcome,
    Scope,
    check_value,
    takes,
    value_str,
)
from .training.sections import TOKENIZER_TYPES, field_policies

__all__ = [
    "DEVICE_REFUSED",
    "ENV_POLICY",
    "FLAG_POLICY",
    "IGNORED",
    "MIGRATED",
    "NO_EFFECT_ARGS",
    "REFUSED",
    "TOKENIZER_TYPES",
    "Accepted",
    "ConfigError",
    "EnvPolicy",
    "FlagPolicy",
    "MigrateAction",
    "Outcome",
    "Scope",
    "check_value",
    "env_policy",
    "flag_policy",
    "ignored_reason",
    "refusal_for",
    "value_str",
]

EnvAction = Literal["rename", "convert", "comment", "keep"]


@dataclass(frozen=True)
class EnvPolicy:
    """A CUDA/NCCL environment variable (exact or ``PREFIX*``) and its Ascend counterpart.

    rename   the variable gets the new name ``to``
    convert  renamed and its value converted (NCCL_BUFFSIZE bytes -> HCCL_BUFFSIZE MB)
    comment  no counterpart: migrate comments the assignment out
    keep     kept unchanged; the reason says what it does on Ascend
    """

    name: str  # migrate's rule name
    match: str
    action: EnvAction
    to: str
    reason: str
    #: rename: the counterpart's valid integer values (low, high, step); a value outside is brought into them
    valid: tuple[int, int, int] | None = None

    def matches(self, variable: str) -> bool:
        return fnmatch.fnmatchcase(variable, self.match)

    def in_range(self, value: int) -> int:
        """``value`` brought into ``valid``: clamped, then down to a multiple of the step."""
        if self.valid is None:
            return value
        low, high, step = self.valid
        return max(low, min(high, value)) // step * step


_TE = TE
_FP8 = "Ascend 910B has no fp8/fp4 compute"
_CUDA_GRAPH = CUDA_GRAPH
_TP_OVERLAP = f"TP communication/GEMM overlap uses TE userbuffers ({_TE})"
_MOE = "this MoE option is not supported by this trainer"
_DEEPEP = DEEPEP
_FSDP = "hybrid sharding (HSDP) and FSDP buffer registration are not supported by this trainer"
_FSDP_INSTEAD = "use --use-megatron-fsdp or --use-torch-fsdp2 without it"
_DROP = DROP
_BF16 = "use --bf16"
_NO_HISTORY = NO_HISTORY


def _refused(
    flag: str, reason: str, alternative: str = _DROP, allowed: tuple[str, ...] | None = None, **migrate: Any
) -> FlagPolicy:
    return FlagPolicy(flag, "refused", reason, alternative, allowed, **migrate)


def _device(
    flag: str, reason: str, alternative: str = _DROP, allowed: tuple[str, ...] | None = None, **migrate: Any
) -> FlagPolicy:
    """Refused because Ascend cannot run it (CUDA-only or no fp8): whatever the trainer."""
    return FlagPolicy(flag, "refused", reason, alternative, allowed, scope="device", **migrate)


def _elsewhere(what: str, *flags: str) -> tuple[FlagPolicy, ...]:
    """Megatron-LM flags of another model or workflow than GPT pretraining."""
    return tuple(_refused(flag, f"it is a flag of Megatron-LM's {what}, not of GPT pretraining") for flag in flags)


def _lacking(reason: str, *flags: str, alternative: str = _DROP, device: bool = False) -> tuple[FlagPolicy, ...]:
    """Megatron-LM flags of a feature this trainer does not have (``device``: Ascend cannot run it)."""
    make = _device if device else _refused
    return tuple(make(flag, reason, alternative) for flag in flags)


def _ignored(flag: str, reason: str, accepted: Accepted | None = None) -> FlagPolicy:
    return FlagPolicy(flag, "ignored", reason, accepted=accepted)


def _mapped(flag: str, name: str, reason: str, allowed: tuple[str, ...] | None = None) -> FlagPolicy:
    return FlagPolicy(flag, "mapped", reason, allowed=allowed, migrate="note", name=name)


# The rows of the flags that are not settings fields (a field carries its own: sections/*.py).
# Exact rows before patterns within each outcome: flag_policy() returns the first match.
_NOT_FIELDS: tuple[FlagPolicy, ...] = (
    # ---- refused ---------------------------------------------------------------------
    # MoE: megatron-core's router, dispatchers and experts run as they are; what needs CUDA-only
    # kernels (DeepEP, TE's fused permutation and router) is refused, with the unfused alternative.
    _device("--moe-enable-deepep", _DEEPEP, "use --moe-token-dispatcher-type alltoall"),
    _device("--moe-flex-dispatcher-backend", _DEEPEP, "use --moe-token-dispatcher-type alltoall"),
    _device(
        "--moe-permute-fusion",
        "the fused MoE permutation is Transformer Engine's (CUDA-only)",
        "drop it (the same permutation runs unfused)",
        migrate="drop",
        name="moe-permute-fusion",
    ),
    _device(
        "--moe-router-fusion",
        "the fused MoE router is Transformer Engine's (CUDA-only)",
        "drop it (the same routing runs unfused)",
        migrate="drop",
        name="moe-router-fusion",
    ),
    _refused("--moe-use-legacy-grouped-gemm", _MOE, "use --moe-grouped-gemm"),
    _refused("--moe-*", _MOE),
    # CUDA graphs and TE's TP overlap are optimisations: migrate drops them (same math).
    _device("--cuda-graph-scope", _CUDA_GRAPH, migrate="drop", name="cuda-graph-scope", takes_value=True),
    _device("--cuda-graph-warmup-steps", _CUDA_GRAPH, migrate="drop", name="cuda-graph-warmup", takes_value=True),
    _device("--enable-cuda-graph", _CUDA_GRAPH, migrate="drop", name="cuda-graph"),
    _device("--external-cuda-graph", _CUDA_GRAPH, migrate="drop", name="external-cuda-graph"),
    _device("--cuda-graph-*", _CUDA_GRAPH),
    _device("--te-rng-tracker", _TE, migrate="drop", name="te-rng-tracker"),
    _device("--tp-comm-overlap-cfg", _TP_OVERLAP, migrate="drop", name="tp-comm-overlap-cfg", takes_value=True),
    _device("--tp-comm-bootstrap-backend", _TP_OVERLAP, migrate="drop", name="tp-comm-bootstrap", takes_value=True),
    _device("--tp-comm-*", _TP_OVERLAP, migrate="drop", name="tp-comm-overlap"),
    _device("--disable-tp-comm-*", _TP_OVERLAP, migrate="drop", name="tp-comm-options"),
    # fp8/fp4 change the numerics: migrate asks (refuses unless --force, which drops them).
    _device("--fp8-format", _FP8, _BF16, migrate="ask", name="fp8-valued", takes_value=True),
    _device("--fp8-recipe", _FP8, _BF16, migrate="ask", name="fp8-recipe", takes_value=True),
    _device("--fp8-margin", _FP8, _BF16, migrate="ask", name="fp8-margin", takes_value=True),
    _device("--fp8-interval", _FP8, _BF16, migrate="ask", name="fp8-interval", takes_value=True),
    _device("--fp8-amax-*", _FP8, _BF16, migrate="ask", name="fp8-amax", takes_value=True),
    _device("--num-layers-at-*-in-bf16", _FP8, _BF16, migrate="ask", name="fp8-bf16-layers", takes_value=True),
    _device("--first-last-layers-bf16", _FP8, _BF16, migrate="ask", name="fp8-first-last-bf16"),
    _device("--fp8*", _FP8, _BF16, migrate="ask", name="fp8"),
    _device("--no-fp8*", _FP8, _BF16, migrate="ask", name="no-fp8-wgrad"),
    _device("--fp4-format", _FP8, _BF16, migrate="ask", name="fp4-valued", takes_value=True),
    _device("--fp4*", _FP8, _BF16, migrate="ask", name="fp4"),
    _refused(
        "--use-custom-fsdp",
        "Megatron-LM core_v0.16.1 has no such flag (use_custom_fsdp is megatron-core's deprecated name)",
        "use --use-megatron-fsdp",
    ),
    _refused("--spec", "this trainer builds the GPT layer spec itself"),
    _refused("--use-legacy-models", "legacy (non-megatron-core) models are gone; megatron-core models are always used"),
    _refused(
        "--overlap-param-gather-with-optimizer-step",
        "Megatron-LM does not support it with distributed checkpointing (always on here)",
    ),
    # Megatron-LM core_v0.16.1 flags of other models and workflows than GPT pretraining, and
    # features this trainer does not have: each refused with its reason, none unrecognised
    # (tests/upstream/test_upstream_megatron_lm.py checks every flag of that tag's parser is covered).
    *_elsewhere(
        "vision models (pretrain_vision_*.py)",
        "--vision-*",
        "--dino-*",
        "--swin-backbone-type",
        "--img-h",
        "--img-w",
        "--num-channels",
        "--patch-dim",
        "--num-classes",
        "--classes-fraction",
        "--data-per-class-fraction",
        "--mask-type",
        "--mask-factor",
        "--iter-per-epoch",
        "--head-lr-mult",
        "--no-data-sharding",
    ),
    *_elsewhere(
        "BERT and retrieval models (pretrain_bert.py, ICT / REALM)",
        "--bert-*",
        "--biencoder-*",
        "--ict-*",
        "--retriever-*",
        "--indexer-*",
        "--mask-prob",
        "--short-seq-prob",
        "--block-data-path",
        "--evidence-data-path",
        "--titles-data-path",
        "--embedding-path",
        "--query-in-block-prob",
        "--use-one-sent-docs",
        "--output-bert-embeddings",
    ),
    *_elsewhere(
        "encoder-decoder models (pretrain_t5.py)",
        "--encoder-num-layers",
        "--encoder-seq-length",
        "--decoder-num-layers",
        "--decoder-seq-length",
        "--relative-attention-*",
    ),
    *_elsewhere(
        "hybrid Mamba models (pretrain_mamba.py)",
        "--mamba-*",
        "--disable-mamba-mem-eff-path",
        "--is-hybrid-model",
        "--hybrid-attention-ratio",
        "--hybrid-mlp-ratio",
        "--hybrid-override-pattern",
        "--linear-*",
        "--experimental-attention-variant",
        "--dsa-indexer-*",
    ),
    *_elsewhere(
        "reinforcement learning (GRPO) training",
        "--rl-*",
        "--no-rl-*",
        "--grpo-*",
        "--langrl-*",
        "--no-langrl-*",
        "--perform-rl-step",
        "--refit-method",
    ),
    *_elsewhere(
        "inference engine (text generation)",
        "--inference-*",
        "--no-inference-*",
        "--enable-chunked-prefill",
        "--disable-chunked-prefill",
        "--flash-decode",
        "--decode-only-cuda-graphs",
        "--mlp-chunks-for-prefill",
        "--nccl-all-reduce-for-prefill",
        "--use-legacy-static-engine",
        "--max-tokens-to-oom",
        "--cache-mla-latents",
        "--mrope-section",
    ),
    *_elsewhere("supervised fine-tuning", "--sft", "--sft-tokenizer-prompt-format"),
    *_lacking("QK-clip needs Transformer Engine >= 2.9 (Megatron-LM asserts it)", "--qk-clip*", device=True),
    *_lacking("this multi-token prediction option is not supported by this trainer", "--mtp-*"),
    *_lacking("the Muon optimizer is not supported by this trainer", "--muon-*", alternative="use --optimizer adam"),
    *_lacking(
        "optimizer and activation offloading to the host are not supported by this trainer",
        "--optimizer-cpu-offload",
        "--optimizer-offload-fraction",
        "--use-torch-optimizer-for-cpu-offload",
        "--overlap-cpu-optimizer-d2h-h2d",
        "--no-pin-cpu-*",
        "--cpu-offloading-num-layers",
        "--fine-grained-activation-offloading",
        "--offload-modules",
        "--min-offloaded-tensor-size",
        alternative="use --recompute-granularity to save activation memory",
    ),
    # FSDP (training/fsdp_args.py defines the flags honoured): hybrid sharding needs megatron-core's
    # HSDP groups, which this trainer does not build; the rest are NCCL user-buffer options
    *_lacking(
        _FSDP,
        "--outer-dp-sharding-strategy",
        "--enable-full-sharding-in-hsdp",
        "--fsdp-*",
        "--no-strict-fsdp-dtensor-load",
        "--disable-strict-fsdp-dtensor-load",
        alternative=_FSDP_INSTEAD,
    ),
    *_lacking(
        "in-process restart and NVIDIA's fault-tolerance package are not supported by this trainer",
        "--inprocess-*",
        "--enable-ft-package",
        "--calc-ft-timeouts",
        "--ft-num-warmup-iters",
        alternative="restart the job with torchrun --max-restarts and --load (a killed save loses nothing)",
    ),
    *_lacking(
        "local and non-persistent checkpoints are not supported by this trainer",
        "--non-persistent-*",
        "--replication",
        "--replication-jump",
        "--replication-factor",
        "--use-persistent-ckpt-worker",
        alternative="use --save with --save-interval",
    ),
    *_lacking(
        "checkpoint conversion at start-up is not supported by this trainer",
        "--ckpt-convert-*",
        "--dist-ckpt-save-pre-mcore-014",
        alternative="convert with `megatron-npu convert` or Megatron-LM's tools/checkpoint",
    ),
    *_lacking(
        "the memory-efficient fully reshardable save is not supported by this trainer",
        "--distrib-optim-fully-reshardable-mem-efficient",
        alternative="drop it (this trainer's optimizer state is always saved fully reshardable)",
    ),
    *_lacking(
        "straggler detection and the workload inspector are not supported by this trainer",
        "--log-straggler",
        "--straggler-*",
        "--disable-straggler-on-startup",
        "--run-workload-inspector-server",
        alternative="drop it; `megatron-npu perf-report` shows each card's share of the step",
    ),
    *_lacking(
        "the rerun state machine (result validation, error injection) is not wired in this trainer",
        "--rerun-mode",
        "--error-injection-*",
        "--result-rejected-tracker-filename",
        alternative="drop it (--check-for-nan-in-loss-and-grad stops on a NaN or Inf loss or gradient)",
    ),
    *_lacking(
        "this dataset option is not supported by this trainer",
        "--fim-*",
        "--data-args-path",
        "--per-split-data-args-path",
        "--per-dataset-sequences-path",
        "--dataloader-fast-cache-load",
        "--dataloader-defer-npy-index-mmap",
        "--object-storage-cache-path",
        "--mid-level-dataset-surplus",
        "--allow-ambiguous-pad-tokens",
        "--sample-rate",
        "--full-validation",
        "--multiple-validation-sets",
        "--phase-transition-iterations",
        "--max-seqlen-per-dp-cp-rank",
        "--hybrid-context-parallel",
        alternative="use --data-path / --split or --train-data-path / --valid-data-path / --test-data-path",
    ),
    *_lacking(
        "this model option is not supported by this trainer",
        "--qk-l2-norm",
        "--attention-output-gate",
        "--heterogeneous-layers-config-*",
        "--use-fused-weighted-squared-relu",
        "--apply-wd-to-qk-layernorm",
        "--no-weight-decay-cond-type",
        "--dump-param-to-param-group-map",
        "--load-main-params-from-ckpt",
        "--init-model-with-meta-device",
        "--decrease-batch-size-if-needed",
        "--save-wgrads-interval",
        "--save-dgrads-interval",
        "--lazy-mpu-init",
        "--fake-process-group",
        "--test-mode",
        "--enable-experimental",
        "--batch-invariant-mode",
        "--onnx-safe",
        "--disable-jit-fuser",
        "--distributed-timeout-seconds-after-init",
        "--pipeline-model-parallel-comm-backend",
        "--ddp-reduce-scatter-with-fp32-accumulation",
        "--overlap-moe-expert-parallel-comm",
        "--delay-wgrad-compute",
        "--ep-overlap-early-attn-memory-release",
        "--adlr-autoresume",
        "--adlr-autoresume-interval",
    ),
    *(
        _device(flag, _FP8, _BF16)
        for flag in ("--keep-fp8-transpose-cache", "--reuse-grad-buf-for-mxfp8-param-ag", "--disable-fp8-wgrad")
    ),
    *_lacking(
        "Transformer Engine's precision-aware optimizer is CUDA-only",
        "--use-precision-aware-optimizer",
        "--main-grads-dtype",
        "--main-params-dtype",
        "--exp-avg-dtype",
        "--exp-avg-sq-dtype",
        device=True,
    ),
    *_lacking(
        f"it configures a CUDA-only component ({_TE}, NCCL, SHARP or a CUDA kernel)",
        "--use-te-activation-func",
        "--te-precision-config-file",
        "--use-kitchen-attention",
        "--kitchen-attention-backend",
        "--cross-entropy-fusion-impl",
        "--disable-bf16-reduced-precision-matmul",
        "--use-nccl-ub",
        "--use-sharp",
        "--sharp-enabled-group",
        "--nccl-communicator-config-path",
        "--symmetric-ar-type",
        "--use-ring-exchange-p2p",
        "--no-tp-comm-*",
        device=True,
    ),
    # ---- ignored: accepted, no effect (args.ignored_flags; the trainer prints each once) --
    _ignored(
        "--dist-ckpt-optim-fully-reshardable",
        "the distributed optimizer's state is always saved fully reshardable (loadable under any TP / PP / DP)",
        TRUE,
    ),
    # ---- ignored, and defined by this table alone: the trainer's parser takes each as
    # Megatron-LM core_v0.16.1 does (``accepted``), into args.no_effect_<name> ----------
    *(
        _ignored(flag, "one_logger and its application tags are NVIDIA's internal telemetry; not used", accepted)
        for flag, accepted in (
            ("--no-one-logger", FALSE),
            ("--one-logger-async", TRUE),
            ("--one-logger-project", takes(str, "megatron-lm")),
            ("--one-logger-run-name", takes(str)),
            ("--app-tag-run-name", takes(str)),
            ("--app-tag-run-version", takes(str, "0.0.0")),
        )
    ),
    _ignored("--disable-msc", "the Multi-Storage Client is not used; paths are local files", FALSE),
    _ignored(
        "--config-logger-dir",
        "entry-point configs are not dumped; the arguments are in LOG_DIR/args.json",
        takes(str, ""),
    ),
    _ignored(
        "--disable-clone-scatter-output-in-embedding",
        "a memory-only option; the embedding output is cloned (megatron-core's default)",
        FALSE,
    ),
    _ignored("--disable-gloo-process-groups", "megatron-core's gloo groups are kept", FALSE),
    *(
        _ignored(flag, "an NCCL communicator tuning; not applied", accepted)
        for flag, accepted in (
            ("--disable-symmetric-registration", TRUE),
            ("--create-all-gather-group", TRUE),
            ("--high-priority-stream-groups", takes(str, (), "*")),
        )
    ),
    *(
        _ignored(flag, "the tokenizer is never read back from the checkpoint", FALSE)
        for flag in (
            "--no-use-tokenizer-model-from-checkpoint-args",
            "--disable-use-tokenizer-model-from-checkpoint-args",
        )
    ),
    _ignored(
        "--exit-signal-handler-for-dataloader",
        "data-loader workers always ignore the exit signal; the main process saves and exits",
        TRUE,
    ),
    _ignored("--log-device-memory-used", "device memory through nvidia-smi is CUDA-only", TRUE),
    _ignored("--log-max-attention-logit", "the largest attention logit is not computed", TRUE),
    _ignored("--log-memory-interval", "memory is not reported at an interval", takes(int)),
    _ignored(
        "--enable-gpt-oss",
        "Megatron-LM core_v0.16.1's pretrain_gpt.py parses it and builds the same model (its fixed YaRN acts only "
        "in ModelOpt's builder, at original max positions 131072 where published gpt-oss says 4096); for gpt-oss's "
        "YaRN give --position-embedding-type yarn with the flags `megatron-npu convert` prints",
        FALSE,
    ),
    # MindSpeed-LLM's fused-op switches (mindspeed_llm/training/arguments.py, _add_fusion_op_args): not
    # Megatron-LM flags; here the fused kernel is chosen by the model's own flags, so migrate drops them.
    *(
        _device(flag, f"it is MindSpeed-LLM's switch; {why}", _DROP, migrate="drop", name=name)
        for flag, name, why in (
            ("--use-fused-rmsnorm", "ms-fused-rmsnorm", "--normalization RMSNorm runs as torch_npu.npu_rms_norm"),
            (
                "--use-fused-swiglu",
                "ms-fused-swiglu",
                "--swiglu runs as torch_npu.npu_swiglu (bias-SwiGLU fusion is on unless --no-bias-swiglu-fusion)",
            ),
            (
                "--use-fused-rotary-pos-emb",
                "ms-fused-rope",
                "RoPE runs as torch_npu.npu_rotary_mul (RoPE fusion is on unless --no-rope-fusion)",
            ),
            (
                "--use-fused-ring-attention-update",
                "ms-fused-ring-update",
                "context parallelism's ring merges blocks with torch_npu.npu_ring_attention_update",
            ),
            (
                "--use-mc2",
                "ms-mc2",
                "MC2 (TP matmuls fused with their collectives) is not implemented here; TP communication runs as "
                "HCCL collectives, the same math",
            ),
            (
                "--use-fused-mlp",
                "ms-fused-mlp",
                "the fused MLP is not implemented here; the MLP runs as megatron-core's (SwiGLU as npu_swiglu), "
                "the same math",
            ),
        )
    ),
    # ---- mapped: honoured by the Ascend counterpart ------------------------------------
    _mapped("--*bias-swiglu-fusion", "bias-swiglu-fusion", "runs as torch_npu.npu_swiglu on NPU"),
    _mapped(
        "--*gradient-accumulation-fusion",
        "grad-acc-fusion",
        "pretrain_gpt.py uses apex's CUDA kernel only where it imports; on NPU the same math runs unfused",
    ),
    _mapped(
        "--*masked-softmax-fusion",
        "masked-softmax-fusion",
        "pretrain_gpt.py uses the CUDA masked-softmax kernel only where it imports; unfused on NPU",
    ),
)

#: The one table: the fields' rows (all exact flags) first, then the others.
FLAG_POLICY: tuple[FlagPolicy, ...] = (*field_policies(), *_NOT_FIELDS)

REFUSED: tuple[FlagPolicy, ...] = tuple(p for p in FLAG_POLICY if p.outcome == "refused")
#: The refusals any trainer on Ascend makes (upstream Megatron-LM's included).
DEVICE_REFUSED: tuple[FlagPolicy, ...] = tuple(p for p in REFUSED if p.scope == "device")
#: flag -> reason, for the flags accepted with no effect.
IGNORED: dict[str, str] = {p.flag: p.reason for p in FLAG_POLICY if p.outcome == "ignored"}
MIGRATED: tuple[FlagPolicy, ...] = tuple(p for p in FLAG_POLICY if p.migrate)
#: The ignored flags no other argument of the trainer's parser defines: it adds them from these rows.
NO_EFFECT_ARGS: tuple[FlagPolicy, ...] = tuple(p for p in FLAG_POLICY if p.accepted is not None)

_NCCL_ONLY = "NCCL setting with no HCCL equivalent"

ENV_POLICY: tuple[EnvPolicy, ...] = (
    EnvPolicy(
        "visible-devices",
        "CUDA_VISIBLE_DEVICES",
        "rename",
        "ASCEND_RT_VISIBLE_DEVICES",
        "NPUs are selected by ASCEND_RT_VISIBLE_DEVICES",
    ),
    EnvPolicy(
        "launch-blocking",
        "CUDA_LAUNCH_BLOCKING",
        "rename",
        "ASCEND_LAUNCH_BLOCKING",
        "torch_npu's synchronous-launch switch for debugging",
    ),
    EnvPolicy(
        "alloc-conf",
        "PYTORCH_CUDA_ALLOC_CONF",
        "rename",
        "PYTORCH_NPU_ALLOC_CONF",
        "torch_npu's caching allocator reads PYTORCH_NPU_ALLOC_CONF (same expandable_segments syntax)",
    ),
    EnvPolicy(
        "max-connections",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "keep",
        "",
        "Megatron asserts CUDA_DEVICE_MAX_CONNECTIONS=1 when TP/CP>1; NPU scripts keep it",
    ),
    EnvPolicy(
        "socket-ifname", "NCCL_SOCKET_IFNAME", "rename", "HCCL_SOCKET_IFNAME", "HCCL bootstrap NIC, same ^/= syntax"
    ),
    EnvPolicy(
        "buffsize",
        "NCCL_BUFFSIZE",
        "convert",
        "HCCL_BUFFSIZE",
        "HCCL_BUFFSIZE is MB per communicator where NCCL_BUFFSIZE is bytes",
    ),
    # CANN's environment-variable reference, Atlas A2/A3: HCCL_RDMA_TIMEOUT in [5, 20] (4.096 us x 2^value, as
    # NCCL_IB_TIMEOUT, whose range reaches 31), HCCL_RDMA_TC a multiple of 4 in [0, 255], HCCL_RDMA_SL in [0, 7].
    EnvPolicy(
        "ib-timeout", "NCCL_IB_TIMEOUT", "rename", "HCCL_RDMA_TIMEOUT", "RoCE retransmission timeout", (5, 20, 1)
    ),
    EnvPolicy("ib-tc", "NCCL_IB_TC", "rename", "HCCL_RDMA_TC", "RoCE traffic class", (0, 255, 4)),
    EnvPolicy("ib-sl", "NCCL_IB_SL", "rename", "HCCL_RDMA_SL", "RoCE service level", (0, 7, 1)),
    EnvPolicy(
        "nccl-debug",
        "NCCL_DEBUG*",
        "comment",
        "",
        "NCCL logging; on Ascend use ASCEND_GLOBAL_LOG_LEVEL / ASCEND_SLOG_PRINT_TO_STDOUT",
    ),
    EnvPolicy("nccl-other", "NCCL_*", "comment", "", _NCCL_ONLY),
    EnvPolicy(
        "torch-nccl",
        "TORCH_NCCL_*",
        "comment",
        "",
        "read by PyTorch's ProcessGroupNCCL only; the HCCL process group ignores it",
    ),
    EnvPolicy("nvte", "NVTE_*", "comment", "", "Transformer Engine setting; TE is not used on NPU"),
    # No HCCL timeout is added to a script: the accelerator sets HCCL_CONNECT_TIMEOUT and
    # HCCL_EXEC_TIMEOUT from --distributed-timeout-minutes wherever the user left them unset
    # (accelerator/npu.py), and an exported default would silently win over the flag.
)


def flag_policy(flag: str) -> FlagPolicy | None:
    """The row for an option string (``--x`` or ``--x=v``): exact rows first, then patterns."""
    name = flag.split("=", 1)[0]
    exact = next((p for p in FLAG_POLICY if not p.is_pattern and p.flag == name), None)
    return exact or next((p for p in FLAG_POLICY if p.is_pattern and p.matches(name)), None)


def refusal_for(flag: str, scope: Scope | None = None) -> FlagPolicy | None:
    """The refused row that covers an option string, or None; ``scope="device"``: only the
    refusals that hold for any trainer on Ascend (what upstream Megatron-LM's patches apply)."""
    row = flag_policy(flag)
    if row is None or row.outcome != "refused" or (scope is not None and row.scope != scope):
        return None
    return row


def ignored_reason(flag: str) -> str | None:
    """Why an accepted flag has no effect, or None when it is honoured."""
    return IGNORED.get(flag.split("=", 1)[0])


def env_policy(variable: str) -> EnvPolicy | None:
    """The mapping of a CUDA/NCCL variable (first match: exact rows precede prefix rows)."""
    return next((p for p in ENV_POLICY if p.matches(variable)), None)
