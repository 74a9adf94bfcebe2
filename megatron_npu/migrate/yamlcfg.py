"""Megatron-LM ``--yaml-cfg`` files: rewritten line by line so comments and layout survive.

Keys are the flags with underscores, flat or inside ``language_model:`` / ``model_parallel:``
sections. pyyaml only reads values; it never writes the file. A removed option is set to
false/null rather than deleted, because Megatron's YAML loader expects a full config.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from .bash import Change, Finding, Result
from .bash_parse import ScanState, split_comment
from .rules import yaml_key_rule

_KEY_RE = re.compile(r"^(\s*)([A-Za-z_]\w*)(\s*:[ \t]*)(\S.*?)?(\s*)$")
# fp8 is on when one of these is set; the other fp8_* keys are inert knobs without it
FP8_SWITCHES = {"fp8", "fp8_format", "fp8_param_gather", "fp8_param", "fp4", "fp4_format", "fp4_param"}


def _parse(value: str) -> Any:
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def flatten(doc: Any) -> dict[str, Any]:
    """Megatron's loader reads language_model/model_parallel sections as flat keys."""
    flat: dict[str, Any] = {}
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key in ("language_model", "model_parallel") and isinstance(value, dict):
                flat.update(value)
            else:
                flat[key] = value
    return flat


def _unset(value: Any) -> bool:
    """Megatron's YAML loader skips null and false (0 is a value: fp8_margin: 0 is set)."""
    return value is None or value is False


def _off(raw: str, value: Any) -> str:
    """false (in the file's spelling) for a boolean, null otherwise."""
    if isinstance(value, bool):
        return "False" if raw[:1].isupper() else "false"
    return "null"


def migrate_yaml(text: str, *, force: bool = False) -> Result:
    res = Result(text="")
    out: list[str] = []
    try:
        flat = flatten(yaml.safe_load(text))
    except yaml.YAMLError:
        flat = {}
    fp8_on = any(not _unset(flat.get(k)) for k in FP8_SWITCHES)
    for idx, line in enumerate(text.split("\n")):
        lineno = idx + 1
        code, comment, _ = split_comment(line, ScanState())
        m = _KEY_RE.match(code)
        rule = yaml_key_rule(m.group(2)) if m and m.group(4) else None
        value = _parse(m.group(4)) if rule is not None else None
        if rule is None or (not _unset(value) and not rule.concerns(str(value))):
            out.append(line)  # no rule, a value the trainer accepts, or one a note is not about
            continue
        indent, key, colon, raw, trail = m.groups()
        new_raw = raw
        reason = rule.reason
        if rule.action == "keep":
            if value not in (None, False, 0, ""):
                res.notes.append(Finding(lineno, f"{key}: {raw}", rule.reason, rule.name))
        elif rule.action == "value":
            old, new = rule.to.split("=")
            if value == old:
                quote = raw[0] if raw[0] in "\"'" else ""
                new_raw = quote + new + quote
        elif rule.action == "remove":
            if not _unset(value):
                new_raw = _off(raw, value)
        elif rule.action == "refuse" and key in FP8_SWITCHES and not _unset(value):
            if not force:
                res.refused.append(Finding(lineno, f"{key}: {raw}", rule.reason, rule.name))
            else:
                new_raw = _off(raw, value)
                reason = "dropped under --force: " + rule.reason
                res.forced.append(Finding(lineno, f"{key}: {raw}", reason, rule.name))
        elif rule.action == "refuse" and not _unset(value) and (force or not fp8_on):
            # an fp8 knob: inert while fp8 is off, and pretrain_gpt.py refuses any set fp8 key
            new_raw = _off(raw, value)
            reason = "fp8 knob, inert without fp8; unset because pretrain_gpt.py refuses fp8 settings"
        if new_raw == raw:
            out.append(line)
            continue
        new = f"{indent}{key}{colon}{new_raw}{trail}{comment}"
        res.changes.append(Change(lineno, line, new, rule.name, reason))
        out.append(new)
    res.text = "\n".join(out)
    return res
