"""Megatron-LM's GPT argument surface (tag core_v0.16.1) for ``pretrain_gpt.py``.

Same flag spellings and the same argparse ``dest`` names as Megatron-LM's
``megatron/training/arguments.py``, so an existing launch script runs unchanged and the
trainer reads ``args.<dest>`` exactly as Megatron-LM code does. ``parse_args`` then does
what Megatron-LM's ``validate_args`` does (derived values, consistency asserts), plus the
layout and path checks that Megatron-LM only hits after process groups exist -- here
every problem is a ``ConfigError`` whose one-line message names the flags to change,
raised before any rank touches a device.

Pure Python: no torch/megatron import (the migration tool imports this module).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable
from typing import Any

# The refused / ignored flags and the tokenizer types are the project's one policy table.
from ..policy import (
    IGNORED,
    NO_EFFECT_ARGS,
    REFUSED,
    TOKENIZER_TYPES,
    ConfigError,
    FlagPolicy,
    check_value,
    refusal_for,
)
from .fsdp_args import add_fsdp_args
from .moe_args import add_moe_args
from .sections import (
    CheckpointSection,
    DataSection,
    LoggingSection,
    ModelSection,
    OptimizerSection,
    ProfilingSection,
    ScheduleSection,
    add_section_arguments,
)
from .settings import Settings
from .validation import validate_args

__all__ = [
    "FLAG_DESTS",
    "IGNORED",
    "REFUSED",
    "TOKENIZER_TYPES",
    "ConfigError",
    "FlagPolicy",
    "build_parser",
    "known_flags",
    "parse_args",
    "refusal_for",
    "validate_args",
]

# ---------------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------------

_EXT = "[megatron-npu extension] "


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def _add_network_size_args(p: argparse.ArgumentParser) -> None:
    add_section_arguments(p, ModelSection, "network size")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(title="training")
    # deprecated: validation refuses them and removes them from the settings
    g.add_argument("--batch-size", type=int, default=None, help="Old batch size parameter, do not use.")
    g.add_argument("--warmup", type=int, default=None, help="Old lr warmup argument, do not use.")
    g.add_argument(
        "--recompute-activations", action="store_true", help="Recompute activations (selective granularity)."
    )
    g.add_argument("--recompute-granularity", type=str, default=None, choices=["full", "selective"])
    g.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        action="store_false",
        dest="check_for_nan_in_loss_and_grad",
        help="Do not check for NaNs in loss and grad.",
    )
    g.add_argument("--check-for-spiky-loss", action="store_true", dest="check_for_spiky_loss")
    g.add_argument("--check-for-large-grads", action="store_true", dest="check_for_large_grads")
    g.add_argument(
        "--distribute-saved-activations",
        action="store_true",
        help="Distribute recomputed activations across the model parallel group.",
    )
    g.add_argument("--recompute-method", type=str, default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="*", type=str, default=None)
    g.add_argument(
        "--no-clone-scatter-output-in-embedding", action="store_false", dest="clone_scatter_output_in_embedding"
    )
    g.add_argument("--use-cpu-initialization", action="store_true", default=None, help="Initialize weights on the CPU.")
    g.add_argument("--empty-unused-memory-level", default=0, type=int, choices=[0, 1, 2])
    g.add_argument("--deterministic-mode", action="store_true")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None)
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--train-sync-interval", type=int, default=None)
    g.add_argument("--checkpoint-activations", action="store_true", help="Deprecated; do not use.")
    g.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion")
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion")
    g.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion")
    g.add_argument(
        "--apply-rope-fusion",
        action="store_true",
        dest="apply_rope_fusion",
        help="Legacy spelling (rope fusion is on by default).",
    )
    g.add_argument("--cross-entropy-loss-fusion", action="store_true", dest="cross_entropy_loss_fusion")
    g.add_argument("--use-flash-attn", action="store_true", help="Use a flash attention kernel.")
    g.add_argument(
        "--no-async-tensor-model-parallel-allreduce",
        "--disable-async-tensor-model-parallel-allreduce",
        action="store_false",
        dest="async_tensor_model_parallel_allreduce",
        help="Deprecated; ignored.",
    )
    g.add_argument("--no-persist-layer-norm", action="store_true")
    g.add_argument("--sequence-parallel", action="store_true", help="Enable sequence parallelism.")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion")
    g.add_argument(
        "--use-mcore-models",
        action="store_true",
        dest="deprecated_use_mcore_models",
        help="Deprecated no-op: megatron-core models are always used.",
    )
    g.add_argument("--manual-gc", action="store_true")
    g.add_argument("--manual-gc-interval", type=int, default=0)
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", action="store_false", dest="manual_gc_eval")


def _add_initialization_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(title="initialization")
    g.add_argument("--seed", type=int, default=1234, help="Random seed.")
    g.add_argument("--data-parallel-random-init", action="store_true")


def _add_mixed_precision_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(title="mixed precision")
    g.add_argument("--fp16", action="store_true", help="Run model in fp16 mode.")
    g.add_argument("--bf16", action="store_true", help="Run model in bfloat16 mode.")
    g.add_argument("--grad-reduce-in-bf16", action="store_true", help="Reduce gradients in bfloat16.")
    g.add_argument("--fp32-residual-connection", action="store_true")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--fp16-lm-cross-entropy", action="store_true")


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--model-parallel-size", type=int, default=None, help="Old argument, do not use.")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    g.add_argument(
        "--microbatch-group-size-per-virtual-pipeline-stage",
        type=int,
        default=None,
        dest="microbatch_group_size_per_vp_stage",
        help="Contiguous microbatches per virtual pipeline stage; pipeline size if not given.",
    )
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm")
    g.add_argument(
        "--overlap-p2p-communication-warmup-flush",
        action="store_true",
        default=False,
        dest="overlap_p2p_comm_warmup_flush",
    )
    g.add_argument(
        "--distributed-backend",
        default="nccl",
        choices=["nccl", "hccl", "gloo"],
        help="Collective backend; nccl is mapped to the device's backend (hccl on Ascend).",
    )
    g.add_argument(
        "--distributed-timeout-minutes",
        type=float,  # Megatron-LM's is int; a fraction lets a test bound a hang in seconds
        default=10,
        help="Timeout of each collective: a rank waiting longer on a hung one fails, and the job "
        "with it (fractions accepted: " + _EXT.strip() + ").",
    )
    g.add_argument("--overlap-grad-reduce", action="store_true", default=False)
    g.add_argument("--defer-embedding-wgrad-compute", action="store_true", default=False)
    g.add_argument("--wgrad-deferral-limit", type=int, default=0)
    g.add_argument("--no-align-grad-reduce", action="store_false", dest="align_grad_reduce")
    g.add_argument("--ddp-num-buckets", type=int, default=None)
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    g.add_argument("--ddp-pad-buckets-for-high-nccl-busbw", action="store_true", default=False)
    g.add_argument("--ddp-average-in-collective", action="store_true", default=False)
    g.add_argument("--overlap-param-gather", action="store_true", default=False)
    g.add_argument("--no-align-param-gather", action="store_false", dest="align_param_gather")
    g.add_argument(
        "--no-scatter-gather-tensors-in-pipeline", action="store_false", dest="scatter_gather_tensors_in_pipeline"
    )
    g.add_argument("--local-rank", type=int, default=int(os.getenv("LOCAL_RANK", "0")))
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"])
    g.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None)
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true", default=False)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument(
        "--transformer-impl",
        default="local",
        choices=["local", "transformer_engine"],
        help="Transformer implementation; only local (the default here) is supported.",
    )
    g.add_argument("--cuda-graph-impl", type=str, default="none", choices=["none", "local", "transformer_engine"])


def _add_tokenizer_args(p: argparse.ArgumentParser) -> None:
    # Megatron-LM core_v0.16.1's tokenizer flags, shared with preprocessing (as upstream shares them)
    from megatron_npu.data.tokenizers import add_tokenizer_args

    add_tokenizer_args(p.add_argument_group(title="tokenizer"))


def _add_misc_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(title="vision / experimental (GPT-relevant subset)")
    g.add_argument(
        "--yaml-cfg",
        type=str,
        default=None,
        help="YAML file of argument values (keys: dests or flag names without dashes, flat or "
        "in sections); explicit command-line flags win over it.",
    )


def _add_no_effect_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM core_v0.16.1 flags accepted for compatibility with no effect here, each with
    upstream's action and default: the policy's rows that name them (policy.NO_EFFECT_ARGS) say how
    and why; the trainer prints the reason once."""
    g = p.add_argument_group(title="accepted without effect (Megatron-LM compatibility)")
    for row in NO_EFFECT_ARGS:
        assert row.accepted is not None  # NO_EFFECT_ARGS holds the rows that have it
        dest = "no_effect_" + row.flag.lstrip("-").replace("-", "_")
        g.add_argument(row.flag, dest=dest, **row.accepted.argparse_kwargs())


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's GPT argument parser (groups as in megatron/training/arguments.py)."""
    p = _Parser(description="megatron-npu pretrain_gpt.py (Megatron-LM arguments)", allow_abbrev=False)
    _add_network_size_args(p)
    add_section_arguments(p, OptimizerSection, "optimizer")
    add_section_arguments(p, ScheduleSection, "schedule")
    _add_training_args(p)
    _add_initialization_args(p)
    add_section_arguments(p, CheckpointSection, "checkpointing")
    _add_mixed_precision_args(p)
    _add_distributed_args(p)
    add_section_arguments(p, DataSection, "data and dataloader")
    _add_tokenizer_args(p)
    add_section_arguments(p, LoggingSection, "logging")
    add_section_arguments(p, ProfilingSection, "profiling")
    _add_misc_args(p)
    add_moe_args(p)
    add_fsdp_args(p)
    _add_no_effect_args(p)
    return p


def _flag_dests(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {s: a.dest for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


#: Every accepted option string -> its argparse dest (the migration tool uses the keys).
FLAG_DESTS: dict[str, str] = _flag_dests(build_parser())


def known_flags() -> set[str]:
    """Every option string pretrain_gpt.py accepts (refused flags with an allowed value included)."""
    return set(FLAG_DESTS)


# ---------------------------------------------------------------------------------------
# YAML
# ---------------------------------------------------------------------------------------

# TransformerConfig spellings that Megatron-LM YAML files use for our dests.
_YAML_ALIASES = {"layernorm_epsilon": "norm_epsilon", "num_moe_experts": "num_experts"}


def _actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    out: dict[str, list[argparse.Action]] = {}
    for a in parser._actions:
        if a.option_strings:
            out.setdefault(a.dest, []).append(a)
    return out


def _coerce(action: argparse.Action, value: Any, where: str) -> Any:
    """A YAML value converted the way argparse converts the same text."""
    flag = action.option_strings[0]
    conv = action.type or str
    try:
        if action.nargs in ("*", "+") or isinstance(action.nargs, int):
            items = value.split() if isinstance(value, str) else (value if isinstance(value, list) else [value])
            return [conv(v) for v in items]
        out = conv(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--yaml-cfg {where}: {value!r} is not a valid value for {flag} ({e})") from None
    if action.choices is not None and out not in action.choices:
        raise ConfigError(f"--yaml-cfg {where}: {value!r} is not one of {list(action.choices)} ({flag})")
    return out


def _yaml_defaults(path: str, parser: argparse.ArgumentParser) -> tuple[dict[str, Any], list[str]]:
    """(dest -> value, flags named) from a Megatron-LM style YAML file."""
    import yaml  # only when --yaml-cfg is used

    if not os.path.isfile(path):
        raise ConfigError(f"--yaml-cfg {path}: no such file")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--yaml-cfg {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--yaml-cfg {path}: expected a mapping of argument names to values")

    by_dest = _actions_by_dest(parser)
    values: dict[str, Any] = {}
    flags: list[str] = []

    def visit(mapping: dict, prefix: str) -> None:
        for key, value in mapping.items():
            key = str(key)
            where = f"{path}: {prefix}{key}"
            norm = _YAML_ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
            flag = "--" + key.replace("_", "-")
            if norm not in by_dest and flag not in FLAG_DESTS and isinstance(value, dict):
                visit(value, f"{prefix}{key}.")  # a section (language_model, model_parallel, ...)
                continue
            if value is None:
                continue  # Megatron-LM YAML files spell "unset" as null
            row = refusal_for(flag) if flag not in FLAG_DESTS else None
            if row is None and norm not in by_dest and flag not in FLAG_DESTS:
                row = refusal_for("--" + norm.replace("_", "-"))
            if row is not None and row.allowed is None:
                if value is False:
                    continue
                raise ConfigError(f"--yaml-cfg {where}: " + row.message(flag))
            if norm == "yaml_cfg":
                raise ConfigError(f"--yaml-cfg {where}: a YAML file cannot name another --yaml-cfg")
            if flag in FLAG_DESTS and norm not in by_dest:
                # A flag spelling whose dest differs (e.g. disable_bias_linear -> add_bias_linear).
                action = next(a for a in parser._actions if flag in a.option_strings)
                if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                    if not isinstance(value, bool):
                        raise ConfigError(f"--yaml-cfg {where}: {flag} takes true/false, not {value!r}")
                    if value:
                        values[action.dest] = action.const
                    flags.append(flag)
                    continue
                values[action.dest] = _coerce(action, value, where)
                flags.append(flag)
                continue
            if norm not in by_dest:
                close = difflib.get_close_matches(norm, list(by_dest), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(f"--yaml-cfg {where}: unknown argument{hint}")
            action = by_dest[norm][0]
            if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                if not isinstance(value, bool):
                    raise ConfigError(f"--yaml-cfg {where}: {norm} takes true/false, not {value!r}")
                values[norm] = value
                named = [a for a in by_dest[norm] if a.const == value]
                if named:  # the flag this value stands for (none when it equals the default)
                    flags.append(named[0].option_strings[0])
                continue
            values[norm] = _coerce(action, value, where)
            flags.append(action.option_strings[0])

    visit(data, "")
    return values, flags


# ---------------------------------------------------------------------------------------
# parse_args / validation
# ---------------------------------------------------------------------------------------


def _given_flags(argv: list[str]) -> list[str]:
    out = []
    for tok in argv:
        if tok == "--":
            break
        if tok.startswith("--") and len(tok) > 2:
            out.append(tok.split("=", 1)[0])
    return out


def parse_args(
    argv: list[str] | None = None,
    *,
    world_size: int | None = None,
    check_paths: bool = True,
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser | None] | None = None,
    args_defaults: dict[str, Any] | None = None,
    check_target: bool | None = None,
) -> Settings:
    """Parse Megatron-LM GPT arguments, fill derived values, check the layout; ConfigError on any problem.

    ``world_size`` defaults to ``$WORLD_SIZE`` (1 when unset). With ``check_paths`` the data
    prefixes and tokenizer files must exist. As in Megatron-LM, ``extra_args_provider`` adds the
    script's own flags to the parser, and ``args_defaults`` fills arguments still unset (None)
    before validation, so a script's default satisfies a required flag. With ``check_target``
    (default: ``check_paths``; both check against the machine that runs the job, which the
    migration tool is not) the accelerator must run ``--distributed-backend``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    given = _given_flags(argv)
    parser = build_parser()
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    flag_dests = _flag_dests(parser) if extra_args_provider is not None else FLAG_DESTS
    for flag in given:
        if flag in flag_dests:
            continue
        row = refusal_for(flag)
        if row is not None:
            raise ConfigError(row.message(flag))
    args, extra = parser.parse_known_args(argv, namespace=Settings())
    if extra:
        raise ConfigError(_unrecognized(extra))
    yaml_flags: list[str] = []
    if args.yaml_cfg is not None:
        defaults, yaml_flags = _yaml_defaults(args.yaml_cfg, parser)
        parser.set_defaults(**defaults)
        args = parser.parse_args(argv, namespace=Settings())  # explicit flags win over YAML values
    args.ignored_flags = []
    args.config_warnings = []
    seen = set()
    for flag in given + yaml_flags:
        if flag in IGNORED and flag not in seen:
            seen.add(flag)
            args.ignored_flags.append((flag, IGNORED[flag]))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    _apply_defaults(args, args_defaults)
    _check_value_refusals(args)
    validate_args(args, world_size=world_size, check_paths=check_paths, given=set(given) | set(yaml_flags))
    if check_paths if check_target is None else check_target:
        _check_backend(args)
    return args


def _check_backend(args: argparse.Namespace) -> None:
    """The accelerator says which backend runs ``--distributed-backend`` (nccl is the device's own)."""
    from megatron_npu.accelerator import get_accelerator  # torch: only when checking for this machine
    from megatron_npu.accelerator.base import UnsupportedBackend

    try:
        get_accelerator().collective_backend_for(args.distributed_backend)
    except UnsupportedBackend as error:
        raise ConfigError(f"--distributed-backend {args.distributed_backend}: {error}") from None


def _apply_defaults(args: argparse.Namespace, defaults: dict[str, Any] | None) -> None:
    """Megatron-LM's ``args_defaults``: a value for every argument the user left unset (None)."""
    for name, value in (defaults or {}).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def _unrecognized(extra: list[str]) -> str:
    bad = [t for t in extra if t.startswith("-")] or extra
    parts = []
    for tok in bad:
        name = tok.split("=", 1)[0]
        close = difflib.get_close_matches(name, list(FLAG_DESTS), n=1) if name.startswith("--") else []
        parts.append(f"{tok} (did you mean {close[0]}?)" if close else tok)
    return "unrecognized arguments: " + " ".join(parts) + " (pretrain_gpt.py does not accept them)"


def _check_value_refusals(args: argparse.Namespace) -> None:
    for row in REFUSED:
        if row.allowed is not None and row.flag in FLAG_DESTS:
            check_value(row, getattr(args, FLAG_DESTS[row.flag]))  # None: not given, a default follows
