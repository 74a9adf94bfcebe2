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
from .sections import (
    CheckpointSection,
    DataSection,
    DistributedSection,
    FsdpSection,
    InitSection,
    LoggingSection,
    MiscSection,
    MixedPrecisionSection,
    ModelSection,
    MoeSection,
    OptimizerSection,
    ProfilingSection,
    ReplacedFlags,
    ScheduleSection,
    Section,
    TokenizerSection,
    TrainingSection,
    add_section_arguments,
    field_fates,
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


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def _add_no_effect_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM core_v0.16.1 flags accepted for compatibility with no effect here, each with
    upstream's action and default: the policy's rows that name them (policy.NO_EFFECT_ARGS) say how
    and why; the trainer prints the reason once."""
    g = p.add_argument_group(title="accepted without effect (Megatron-LM compatibility)")
    for row in NO_EFFECT_ARGS:
        assert row.accepted is not None  # NO_EFFECT_ARGS holds the rows that have it
        dest = "no_effect_" + row.flag.lstrip("-").replace("-", "_")
        g.add_argument(row.flag, dest=dest, **row.accepted.argparse_kwargs())


#: The parser's groups in Megatron-LM's order: each generated from its section's fields.
PARSER_GROUPS: tuple[tuple[type[Section], str], ...] = (
    (ModelSection, "network size"),
    (OptimizerSection, "optimizer"),
    (ScheduleSection, "schedule"),
    (TrainingSection, "training"),
    (ReplacedFlags, "deprecated and shorthand flags"),
    (InitSection, "initialization"),
    (CheckpointSection, "checkpointing"),
    (MixedPrecisionSection, "mixed precision"),
    (DistributedSection, "distributed"),
    (DataSection, "data and dataloader"),
    (TokenizerSection, "tokenizer"),
    (LoggingSection, "logging"),
    (ProfilingSection, "profiling"),
    (MiscSection, "experimental"),
    (MoeSection, "moe"),
    (FsdpSection, "fsdp"),
)


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's GPT argument parser: one group per section, then the flags accepted without effect."""
    p = _Parser(description="megatron-npu pretrain_gpt.py (Megatron-LM arguments)", allow_abbrev=False)
    for section, title in PARSER_GROUPS:
        add_section_arguments(p, section, title)
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
    _check_field_refusals(args, set(given) | set(yaml_flags))
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


def _check_field_refusals(args: argparse.Namespace, given: set[str]) -> None:
    """The refusals the sections' fields carry, after parsing (inside argparse, its own text would prefix
    the policy's message): a refused value, or a refused flag given at all."""
    for section, _ in PARSER_GROUPS:
        for dest, rows in field_fates(section).items():
            for row in rows:
                if row.outcome != "refused":
                    continue
                if row.allowed is not None:
                    check_value(row, getattr(args, dest))  # None: not given, a default follows
                elif row.flag in given:
                    raise ConfigError(row.message(row.flag))
