"""Bash launch scripts rewritten line by line: comments and layout survive.

Each line's code (bash_parse.split_comment) goes through the environment, flag and entry
point rules; a here-document's body is copied as is. Reading the launch command is
bash_parse's job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .bash_parse import ScanState, ends_heredoc, heredoc_end, split_comment
from .rules import ENTRY_RULE, HEADER_RULE, KEEP_ENTRY_RULE, NPU_DIR_RULE, Rule, env_rule, flag_rule

TAG = "megatron-npu migrate"


@dataclass
class Change:
    line: int  # 1-based line of the input (inserted lines: the input line they follow)
    before: str | None
    after: str | None  # None: the line was deleted
    rule: str
    reason: str

    def to_json(self) -> dict:
        return {"line": self.line, "before": self.before, "after": self.after, "rule": self.rule, "reason": self.reason}


@dataclass
class Finding:
    line: int | None
    item: str
    reason: str
    rule: str = ""

    def to_json(self) -> dict:
        return {"line": self.line, "item": self.item, "reason": self.reason, "rule": self.rule}


@dataclass
class Result:
    text: str
    changes: list[Change] = field(default_factory=list)
    unsupported: list[Finding] = field(default_factory=list)  # warnings: left as they were
    notes: list[Finding] = field(default_factory=list)  # kept, with what runs on NPU
    refused: list[Finding] = field(default_factory=list)  # fp8 etc. without --force
    forced: list[Finding] = field(default_factory=list)  # refused items dropped under --force


# ---------------------------------------------------------------------------------------
# flags inside a line's code
# ---------------------------------------------------------------------------------------

_FLAG_RE = re.compile(r"(?<![^\s\"'(])(--[A-Za-z0-9][\w-]*)(?==|[\s\"')]|$)")
_VALUE_RE = re.compile(r"""(=|[ \t]+)("[^"]*"|'[^']*'|[^\s"'()\\]+)""")


def _value_span(code: str, end: int) -> tuple[int, str | None]:
    """The flag's value on this line: (end of the value, value) or (end, None)."""
    m = _VALUE_RE.match(code, end)
    if not m or (m.group(1) != "=" and m.group(2).startswith("-") and not re.match(r"-\d", m.group(2))):
        return end, None
    return m.end(), m.group(2)


def _cut(code: str, start: int, end: int) -> str:
    """Remove code[start:end] and one side's whitespace so no double space is left."""
    before, after = code[:start], code[end:]
    stripped = after.lstrip(" \t")
    if len(stripped) < len(after) and stripped:
        return before + stripped
    if not before.strip():  # keep the indentation of a line like '    --flag"'
        return before + stripped
    if not stripped:  # the end of the code: keep the spacing before a comment
        return before.rstrip(" \t") + after
    return before.rstrip(" \t") + stripped


def _with_own_quotes(code: str, start: int, end: int) -> tuple[int, int]:
    """The span widened to its quotes when it is a whole quoted word (``"--fp8-format hybrid"``, an array
    element in Megatron-LM's example scripts): removing the flag then leaves no empty ``""`` word."""
    if 0 < start and end < len(code) and code[start - 1] in "\"'" and code[end] == code[start - 1]:
        if (start == 1 or code[start - 2] in " \t(") and (end + 1 == len(code) or code[end + 1] in " \t)"):
            return start - 1, end + 1
    return start, end


def _replace_flag(code: str, start: int, end: int, replacement: str) -> str:
    """``--flag value`` -> ``replacement`` (inside a quoted word too)."""
    return code[:start] + replacement + code[end:]


def rewrite_flags(code: str, lineno: int, force: bool, res: Result, device_wide_only: bool = False) -> str:
    pos = 0
    while True:
        m = _FLAG_RE.search(code, pos)
        if not m:
            return code
        flag = m.group(1)
        rule = flag_rule(flag, device_wide_only)
        pos = m.end()
        if rule is None:
            continue
        vend, value = _value_span(code, m.end())
        if not rule.concerns(value):
            continue  # a value the trainer accepts, or one a note is not about
        if rule.action == "keep":
            item = flag if rule.allowed is None else f"{flag} {value}"
            res.notes.append(Finding(lineno, item, rule.reason, rule.name))
        elif rule.action == "value":
            old, new = rule.to.split("=")
            if value is not None and value.strip("\"'") == old:
                vstart = vend - len(value)
                quoted = value[0] if value[0] in "\"'" else ""
                code = code[:vstart] + quoted + new + quoted + code[vend:]
                res.changes.append(Change(lineno, None, None, rule.name, rule.reason))
                pos = vstart + len(new)
        elif rule.action == "replace":
            code = _replace_flag(code, m.start(), vend, rule.to)
            res.changes.append(Change(lineno, None, None, rule.name, rule.reason))
            pos = m.start() + len(rule.to)
        elif rule.action in ("remove", "refuse"):
            end = vend if rule.takes_value else m.end()
            text = code[m.start() : end]
            if rule.action == "refuse" and not force:
                res.refused.append(Finding(lineno, text, rule.reason, rule.name))
                continue
            if rule.action == "refuse":
                res.forced.append(Finding(lineno, text, "dropped under --force: " + rule.reason, rule.name))
            start, end = _with_own_quotes(code, m.start(), end)
            code = _cut(code, start, end)
            res.changes.append(
                Change(
                    lineno,
                    None,
                    None,
                    rule.name,
                    rule.reason if rule.action == "remove" else "dropped under --force: " + rule.reason,
                )
            )
            pos = m.start()


# ---------------------------------------------------------------------------------------
# environment variables and the entry point inside a line's code
# ---------------------------------------------------------------------------------------

_ENV_NAME_RE = re.compile(r"\b((?:NCCL|TORCH_NCCL|NVTE|CUDA|PYTORCH_CUDA)_[A-Z0-9_]+)\b")
_ASSIGN_RE = r"(?:(?<=^)|(?<=[\s;]))(?:export[ \t]+)?{name}(?:=(\"[^\"]*\"|'[^']*'|[^\s;]*))?"
_ENTRY_RE = re.compile(r"(?<![^\s\"'=])([^\s\"'=;|&()]*pretrain_gpt\.py)(?![\w.])")
_ENTRY_DONE = ("${MEGATRON_NPU_DIR}/pretrain_gpt.py", "$MEGATRON_NPU_DIR/pretrain_gpt.py")


def _buffsize_mb(value: str) -> str | None:
    raw = value.strip("\"'")
    return str(max(1, int(raw) // (1 << 20))) if raw.isdigit() else None


def _into_range(code: str, rule: Rule, reason: str) -> tuple[str, str]:
    """The renamed variable's literal values (``X=22``, ``X=${X:-22}``) brought into its valid range; the
    reason says what changed, so the report shows it."""
    assert rule.env is not None and rule.env.valid is not None
    low, high, step = rule.env.valid
    said = f"{low}-{high}" + (f", a multiple of {step}" if step > 1 else "")
    name = re.escape(rule.to)
    value = re.compile(rf"(\b{name}=[\"']?(?:\$\{{{name}:?-)?)(\d+)")
    notes: list[str] = []

    def fix(m: re.Match) -> str:
        given = int(m.group(2))
        fixed = rule.env.in_range(given)  # type: ignore[union-attr]
        if fixed != given:
            notes.append(f"{given} -> {fixed}: {rule.to} takes {said} on Atlas A2/A3")
        return m.group(1) + str(fixed)

    code = value.sub(fix, code)
    return code, reason + (f" ({'; '.join(notes)})" if notes else "")


def rewrite_env(code: str, lineno: int, res: Result) -> tuple[str, bool]:
    """Returns (code, commented): commented means the whole statement is to be commented out."""
    for name in dict.fromkeys(_ENV_NAME_RE.findall(code)):
        rule = env_rule(name)
        if rule is None:
            if re.search(_ASSIGN_RE.format(name=re.escape(name)) + r"(?==)", code):
                res.unsupported.append(Finding(lineno, name, "CUDA setting with no Ascend counterpart; left as is"))
            continue
        if rule.action == "keep":
            res.notes.append(Finding(lineno, name, rule.reason, rule.name))
        elif rule.action in ("rename", "convert"):
            new_code = re.sub(rf"\b{re.escape(name)}\b", rule.to, code)
            reason = rule.reason
            if rule.action == "convert":
                m = re.search(rf"\b{rule.to}=(\"[^\"]*\"|'[^']*'|[^\s;]*)", new_code)
                mb = _buffsize_mb(m.group(1)) if m else None
                if m and mb is not None:
                    new_code = new_code[: m.start(1)] + mb + new_code[m.end(1) :]
                    reason += f" ({m.group(1)} bytes -> {mb} MB)"
                elif m:
                    res.unsupported.append(
                        Finding(
                            lineno,
                            name,
                            f"{rule.to} is in MB, {name} was bytes: convert the value {m.group(1)} by hand",
                            rule.name,
                        )
                    )
            if rule.env is not None and rule.env.valid is not None:
                new_code, reason = _into_range(new_code, rule, reason)
            code = new_code
            res.changes.append(Change(lineno, None, None, rule.name, reason))
        elif rule.action == "comment":
            # NAME=value anywhere (export/inline prefix), or a bare "export NAME"
            pat = re.compile(rf"(?:(?<=^)|(?<=[\s;])){re.escape(name)}(?:(=(?:\"[^\"]*\"|'[^']*'|[^\s;]*))|(?=\s|;|$))")
            for m in reversed(list(pat.finditer(code))):
                if m.group(1) is None and not re.search(r"\bexport[ \t]+$", code[: m.start()]):
                    continue  # a reference such as "unset NAME": harmless, left alone
                code = _cut(code, m.start(), m.end())
                res.changes.append(Change(lineno, None, None, rule.name, rule.reason))
                if re.fullmatch(r"\s*(export)?\s*;?\s*", code):
                    return code, True  # nothing else on the line: comment the statement out
    return code, False


_RUN_MODULE = "-m megatron_npu.run"


def keep_entry(code: str, lineno: int, res: Result) -> str:
    """The user's own pretrain_gpt.py stays; its launcher runs it through megatron_npu.run.

    ``torchrun ... X/pretrain_gpt.py``, ``python -m torch.distributed.launch ... X/pretrain_gpt.py``
    and ``python X/pretrain_gpt.py`` all take ``-m MODULE ARGS`` in the script's place.
    """

    def sub(m: re.Match) -> str:
        if re.search(rf"{re.escape(_RUN_MODULE)}\s+$", code[: m.start()]):
            return m.group(1)  # already migrated
        res.changes.append(Change(lineno, None, None, KEEP_ENTRY_RULE.name, KEEP_ENTRY_RULE.reason))
        return f"{_RUN_MODULE} {m.group(1)}"

    return _ENTRY_RE.sub(sub, code)


def rewrite_entry(code: str, lineno: int, res: Result) -> str:
    if re.match(r"\s*(echo|printf)\s", code):
        return code  # a message that names the script, not a launch

    def sub(m: re.Match) -> str:
        if m.group(1) in _ENTRY_DONE:
            return m.group(1)
        res.changes.append(Change(lineno, None, None, ENTRY_RULE.name, ENTRY_RULE.reason))
        return ENTRY_RULE.to

    return _ENTRY_RE.sub(sub, code)


# ---------------------------------------------------------------------------------------
# the script
# ---------------------------------------------------------------------------------------


def _added_block(text: str, npu_dir: str, needs_dir: bool) -> list[tuple[str, Rule]]:
    """What the script gets that it did not set: MEGATRON_NPU_DIR when the entry point moved to it.
    No HCCL timeout: the trainer derives them from --distributed-timeout-minutes where unset."""
    code = "\n".join(split_comment(line, ScanState())[0] for line in text.splitlines())
    block: list[tuple[str, Rule]] = []
    if needs_dir and not re.search(r"(?:^|[\s;])(?:export\s+)?MEGATRON_NPU_DIR=", code, re.M):
        block.append((f"MEGATRON_NPU_DIR=${{MEGATRON_NPU_DIR:-{npu_dir}}}", NPU_DIR_RULE))
    return block


def migrate_bash(text: str, *, force: bool = False, npu_dir: str = ".", keep_entry_point: bool = False) -> Result:
    lines = text.split("\n")
    res = Result(text="")
    out: list[str | None] = []
    state = ScanState()
    insert_after = 0  # input line after which the added settings go
    seen_entry = False
    heredoc: tuple[str, bool] | None = None
    for idx, line in enumerate(lines):
        lineno = idx + 1
        if heredoc is not None:  # a here-document's body is data, not script
            out.append(line)
            if ends_heredoc(line, heredoc):
                heredoc = None
            continue
        start = state
        code, comment, state = split_comment(line, start)
        heredoc = heredoc_end(code) if state.quote is None else None
        if not code.strip() or (start.quote is None and code.lstrip().startswith("#!")):
            out.append(line)
            continue
        nchanges = len(res.changes)
        new_code, commented = rewrite_env(code, lineno, res)
        if not commented:
            new_code = rewrite_flags(new_code, lineno, force, res, device_wide_only=keep_entry_point)
            new_code = (keep_entry if keep_entry_point else rewrite_entry)(new_code, lineno, res)
        if "pretrain_gpt.py" in code:
            seen_entry = True
        # the added settings go after the last top-level export ahead of the launch
        if (
            not seen_entry
            and start.depth == 0
            and start.quote is None
            and not start.continued
            and re.match(r"export\s", line)
        ):
            insert_after = lineno
        if len(res.changes) == nchanges:
            out.append(line)
            continue
        if commented:
            reasons = "; ".join(dict.fromkeys(ch.reason for ch in res.changes[nchanges:]))
            new = f"# {line.strip()}  # {TAG}: {reasons}"
            new = line[: len(line) - len(line.lstrip())] + new
        elif new_code.strip(" \t\\") == "":
            if comment:  # keep the comment at the line's indentation
                new = line[: len(line) - len(line.lstrip())] + comment
            elif start.depth or start.quote or new_code.rstrip().endswith("\\"):
                new = None  # safe to delete: inside an array/string, or a continued line
            else:
                new = ""  # the end of a continued command: an empty line still ends it
        else:
            new = new_code + comment
        for ch in res.changes[nchanges:]:
            ch.before, ch.after = line, new
        out.append(new)
    needs_dir = any(ch.rule == ENTRY_RULE.name for ch in res.changes) or "MEGATRON_NPU_DIR" in text
    block = _added_block(text, npu_dir, needs_dir)
    if block:
        if insert_after == 0 and lines and lines[0].startswith("#!"):
            insert_after = 1
        added = [f"# {TAG}: Ascend settings (override from the environment)"] + [b for b, _ in block]
        out[insert_after:insert_after] = added
        for b, rule in block:
            res.changes.append(Change(insert_after, None, b, rule.name, rule.reason))
        res.changes.append(Change(insert_after, None, added[0], HEADER_RULE.name, HEADER_RULE.reason))
    res.changes.sort(key=lambda c: c.line)
    res.text = "\n".join(x for x in out if x is not None)
    return res
