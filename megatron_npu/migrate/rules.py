"""The migration rules: one row per rule, each with its reason (``megatron-npu migrate --list-rules``).

The environment and flag rows come from the project's policy table (megatron_npu/policy.py),
the one the trainer refuses and ignores flags by; only the entry-point rows are migrate's own.

A rule matches an environment variable (``kind="env"``, exact name or ``PREFIX*``), a
Megatron-LM flag (``kind="flag"``, exact flag or ``--prefix*``; the same rule covers the
``--yaml-cfg`` key spelled with underscores), the entry point or the settings added to a
script. Everything no rule names is copied byte for byte.

Actions:
  rename   env: the variable gets the new name (assignments and references)
  convert  env: renamed and its value converted (NCCL_BUFFSIZE bytes -> HCCL_BUFFSIZE MB)
  comment  env: the assignment is commented out with the reason
  keep     kept unchanged, with a note saying what runs on NPU
  add      entry: MEGATRON_NPU_DIR (with a ``${VAR:-default}`` default) and the header line,
           added when the script does not set them (no HCCL timeout: the trainer derives those
           from --distributed-timeout-minutes where the environment leaves them unset)
  value    flag: one value is replaced by another (``old=new``)
  replace  flag: the flag and its value are replaced by another flag (``--attention-backend fused`` ->
           ``--use-flash-attn``), for the values the rule names
  remove   flag: removed with its value (YAML: set to false/null); a value pretrain_gpt.py
           accepts (``allowed``) stays
  refuse   flag: the migration is refused unless --force, which removes it like ``remove``
  entry    the Megatron-LM ``pretrain_gpt.py`` becomes this project's
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from ..policy import ENV_POLICY, MIGRATED, EnvPolicy, FlagPolicy


@dataclass(frozen=True)
class Rule:
    name: str
    kind: str  # "env" | "flag" | "entry"
    match: str  # env name or NAME_* prefix, flag or --prefix*, or "pretrain_gpt.py"
    action: str  # see the module docstring
    to: str = ""  # new name / "old=new" value / added default
    reason: str = ""
    takes_value: bool = False  # flag: a removed flag's value goes with it
    #: remove/refuse: values pretrain_gpt.py accepts, left in place; keep: the values noted
    allowed: tuple[str, ...] | None = None
    #: flag: the policy row holds for any trainer on Ascend (scope "device"), upstream
    #: Megatron-LM's included; the other rows are about this project's pretrain_gpt.py.
    device_wide: bool = False
    #: env rename: the counterpart's valid values (policy.EnvPolicy.valid); None: any
    env: EnvPolicy | None = None

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.match)

    def concerns(self, value: str | None) -> bool:
        """False for a value the rule leaves alone (an accepted value of a refused flag,
        or a value a note is not about)."""
        if self.allowed is None:
            return True
        given = None if value is None else value.strip("\"'")
        return given not in self.allowed if self.action in ("remove", "refuse") else given in self.allowed


# What migrate does with a flag follows the trainer's policy (megatron_npu/policy.py):
# a flag the trainer refuses is dropped (a CUDA-only optimisation: the math is the same),
# or refused unless --force (fp8: the numerics would change); a mapped one gets a note.
_FLAG_ACTIONS = {"drop": "remove", "ask": "refuse", "rewrite": "value", "replace": "replace", "note": "keep"}


def _flag_rule(p: FlagPolicy) -> Rule:
    action = _FLAG_ACTIONS[p.migrate]
    reason = "kept: " + p.reason if action == "keep" else p.reason
    if action == "refuse":
        reason += "; refused unless --force, which drops the flag"
    allowed = None if action == "value" else p.allowed  # a rewrite names its own old value
    return Rule(p.name, "flag", p.flag, action, p.rewrite, reason, p.takes_value, allowed, p.scope == "device")


RULES: list[Rule] = [
    *(Rule(e.name, "env", e.match, e.action, e.to, e.reason, env=e) for e in ENV_POLICY),
    *(_flag_rule(p) for p in MIGRATED),
    # ---- entry point --------------------------------------------------------------------
    Rule(
        "entry",
        "entry",
        "pretrain_gpt.py",
        "entry",
        "${MEGATRON_NPU_DIR}/pretrain_gpt.py",
        "this project's Megatron-LM-compatible trainer; MEGATRON_NPU_DIR (added with a default of "
        "this checkout) says where it lives",
    ),
    Rule(
        "keep-entry",
        "entry",
        "pretrain_gpt.py",
        "entry",
        "-m megatron_npu.run <your pretrain_gpt.py>",
        "--keep-entry-point: your own Megatron-LM pretrain_gpt.py, unmodified, run by megatron_npu.run, which "
        "applies the patch layer (megatron/training included) first",
    ),
    Rule(
        "npu-dir",
        "entry",
        "MEGATRON_NPU_DIR",
        "add",
        "<--megatron-npu-dir, default: this checkout>",
        "where this project's pretrain_gpt.py lives; added (overridable from the environment) when the entry "
        "point was rewritten and the script does not set it",
    ),
    Rule(
        "added-header",
        "entry",
        "# megatron-npu migrate: ...",
        "add",
        "",
        "a comment line that marks the settings the migration added",
    ),
]

ENV_RULES = [r for r in RULES if r.kind == "env"]
FLAG_RULES = [r for r in RULES if r.kind == "flag"]
ENTRY_RULE = next(r for r in RULES if r.name == "entry")
KEEP_ENTRY_RULE = next(r for r in RULES if r.name == "keep-entry")
NPU_DIR_RULE = next(r for r in RULES if r.name == "npu-dir")
HEADER_RULE = next(r for r in RULES if r.name == "added-header")


def env_rule(name: str) -> Rule | None:
    return next((r for r in ENV_RULES if r.matches(name)), None)


def flag_rule(flag: str, device_wide_only: bool = False) -> Rule | None:
    """The rule for ``--flag`` (first match wins: exact rows precede prefix rows).

    ``device_wide_only``: only rows that hold for any trainer (a script that keeps its own
    Megatron-LM entry point: this trainer's rows, such as ``--distributed-backend nccl=hccl``,
    which upstream's parser rejects, do not apply to it)."""
    return next((r for r in FLAG_RULES if r.matches(flag) and (r.device_wide or not device_wide_only)), None)


def yaml_key_rule(key: str) -> Rule | None:
    return flag_rule("--" + key.replace("_", "-"))


def format_rules() -> str:
    width = max(len(r.name) for r in RULES)
    mwidth = max(len(r.match) for r in RULES)
    out = [f"{'rule'.ljust(width)}  {'kind':5} {'action':7} {'match'.ljust(mwidth)}  to / reason"]
    for r in RULES:
        to = f"-> {r.to}; " if r.to else ""
        out.append(f"{r.name.ljust(width)}  {r.kind:5} {r.action:7} {r.match.ljust(mwidth)}  {to}{r.reason}")
    return "\n".join(out)
