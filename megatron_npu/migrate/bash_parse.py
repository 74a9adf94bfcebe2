"""Reading bash launch scripts: where a line's code ends, and the launch command expanded.

A small expander, not a bash interpreter: simple variables, arrays, ``${X:-d}`` and
``$((..))`` are resolved; what it cannot resolve stays as literal text (``$1``,
``$(cmd)``), and the checks that need it say so instead of guessing. The rewriter
(bash.py) uses the line scanner; cli.py uses ``find_launch`` for the layout and flag checks.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------
# scanning: where a line's code ends (comment), quote state and array depth across lines
# ---------------------------------------------------------------------------------------


@dataclass
class ScanState:
    quote: str | None = None  # open ' or " carried into the next line
    depth: int = 0  # unclosed ( outside quotes: inside NAME=( ... )
    continued: bool = False  # the previous line ended with a backslash


def split_comment(line: str, state: ScanState) -> tuple[str, str, ScanState]:
    """(code, comment, state after the line)."""
    quote, depth = state.quote, state.depth
    i, n = 0, len(line)
    cut = n
    while i < n:
        c = line[i]
        if quote == "'":
            if c == "'":
                quote = None
        elif quote == '"':
            if c == "\\":
                i += 1
            elif c == '"':
                quote = None
        else:
            if c == "\\":
                i += 1
            elif c in "'\"":
                quote = c
            elif c == "#" and (i == 0 or line[i - 1] in " \t(;"):
                cut = i
                break
            elif c == "(":
                depth += 1
            elif c == ")":
                depth = max(0, depth - 1)
        i += 1
    code, comment = line[:cut], line[cut:]
    continued = quote is None and cut == n and code.rstrip(" \t").endswith("\\") and not code.rstrip().endswith("\\\\")
    return code, comment, ScanState(quote, depth, continued)


_HEREDOC_RE = re.compile(r"(?<!<)<<(-?)[ \t]*(['\"]?)([A-Za-z_]\w*)\2")


def heredoc_end(code: str) -> tuple[str, bool] | None:
    """(terminator, tabs allowed) when the line opens a here-document (its body is copied as is)."""
    m = _HEREDOC_RE.search(code)
    return (m.group(3), m.group(1) == "-") if m else None


def ends_heredoc(line: str, heredoc: tuple[str, bool]) -> bool:
    word, dash = heredoc
    return (line.lstrip("\t") if dash else line) == word


# ---------------------------------------------------------------------------------------
# expansion of the launch command
# ---------------------------------------------------------------------------------------


@dataclass
class Launch:
    line: int
    launcher: list[str]
    entry: str
    args: list[str]
    variables: dict[str, str | list[str]]

    @property
    def kind(self) -> str:
        """ "torchrun" (torchrun, python -m torch.distributed.launch/run), "python" or "other" (srun, ...)."""
        words = [w for w in self.launcher if not re.fullmatch(r"[A-Za-z_]\w*=.*", w) and w != "env"]
        if not words:
            return "python"  # ./pretrain_gpt.py
        first = words[0].rsplit("/", 1)[-1]
        if first == "torchrun" or any(w in ("torch.distributed.launch", "torch.distributed.run") for w in words[:4]):
            return "torchrun"
        return "python" if first.startswith("python") else "other"

    def launcher_value(self, *names: str) -> str | None:
        value = None
        for i, tok in enumerate(self.launcher):
            for name in names:
                if tok == name and i + 1 < len(self.launcher):
                    value = self.launcher[i + 1]
                elif tok.startswith(name + "="):
                    value = tok.split("=", 1)[1]
        return value


def logical_lines(text: str) -> list[tuple[int, str]]:
    """Statements with comments removed and continuations/arrays/strings joined."""
    out: list[tuple[int, str]] = []
    state = ScanState()
    buf: list[str] = []
    first = 0
    heredoc: tuple[str, bool] | None = None
    for idx, line in enumerate(text.split("\n")):
        if heredoc is not None:
            if ends_heredoc(line, heredoc):
                heredoc = None
            continue
        start = state
        code, _, state = split_comment(line, start)
        heredoc = heredoc_end(code) if state.quote is None else None
        if not buf:
            first = idx + 1
        if state.continued or (state.quote == '"' and code.endswith("\\")):
            code = code.rstrip()[:-1]  # backslash-newline is removed, in and out of double quotes
        buf.append(code)
        if state.quote is None and state.depth == 0 and not state.continued:
            joined = " ".join(buf)
            if joined.strip():
                out.append((first, joined))
            buf = []
    if buf and " ".join(buf).strip():
        out.append((first, " ".join(buf)))
    return out


_VAR_RE = re.compile(r"\$\{(\w+)(\[[@*]\])?(?::?-([^}]*))?\}|\$([A-Za-z_]\w*)")
_ARITH_RE = re.compile(r"\$\(\((.*?)\)\)")
_QUOTED_ARRAY_RE = re.compile(r'"\$\{(\w+)\[@\]\}"')


def _single_quoted(s: str) -> list[bool]:
    mask, quote = [], None
    for c in s:
        if quote == "'":
            mask.append(True)
            if c == "'":
                quote = None
            continue
        if c == "'" and quote is None:
            quote = "'"
            mask.append(True)
            continue
        if c == '"':
            quote = None if quote == '"' else '"'
        mask.append(False)
    return mask


def _outside_single_quotes(regex: re.Pattern, s: str, fn) -> str:
    mask = _single_quoted(s)
    return regex.sub(lambda m: m.group(0) if mask[m.start()] else fn(m), s)


def expand(s: str, env: dict[str, str | list[str]]) -> str:
    """Substitute the variables bash would (outside single quotes); unknown ones stay literal."""

    def var(m: re.Match) -> str:
        v = env.get(m.group(1) or m.group(4))
        if v is None:
            return expand(m.group(3), env) if m.group(3) is not None else m.group(0)
        # unquoted ${A[@]}: bash splits each element into words, so "--data-path $DATA" is a flag and its value
        return " ".join(v) if isinstance(v, list) else v

    def arith(m: re.Match) -> str:
        inner = _VAR_RE.sub(var, m.group(1))
        inner = re.sub(r"\b[A-Za-z_]\w*\b", lambda v: str(env.get(v.group(0), v.group(0))), inner)
        if re.fullmatch(r"[\d\s+\-*/%()]+", inner):
            try:  # digits and operators only: safe to evaluate
                return str(int(eval(inner.replace("/", "//"), {"__builtins__": {}})))
            except (SyntaxError, ZeroDivisionError):
                pass
        return m.group(0)

    def quoted_array(m: re.Match) -> str:  # "${A[@]}": one word per element
        v = env.get(m.group(1))
        return shlex.join(v) if isinstance(v, list) else m.group(0)

    s = _outside_single_quotes(_QUOTED_ARRAY_RE, s, quoted_array)
    return _outside_single_quotes(_VAR_RE, _outside_single_quotes(_ARITH_RE, s, arith), var)


def _words(s: str) -> list[str]:
    lex = shlex.shlex(s, posix=True, punctuation_chars=";&|<>")
    lex.whitespace_split = True
    lex.commenters = ""
    try:
        return list(lex)
    except ValueError:
        return s.split()


_ARRAY_RE = re.compile(
    r"\s*(?:export\s+|declare\s+-a\s+|local\s+|readonly\s+)?([A-Za-z_]\w*)(\+?)=\((.*)\)\s*;?\s*", re.S
)
_SCALAR_RE = re.compile(
    r"\s*(?:export\s+|local\s+|readonly\s+)?([A-Za-z_]\w*)(\+?)=(\S*|\"[^\"]*\"|'[^']*')\s*;?\s*", re.S
)


_IF_RE = re.compile(r"\s*(el)?if\s+(.+?)\s*;?\s*then\s*")
_ELSE_RE = re.compile(r"\s*else\s*")
_FI_RE = re.compile(r"\s*fi\s*;?\s*")
_TEST_RE = re.compile(r"(!\s+)?(?:\[\[(.*?)\]\]|\[\s(.*?)\s\])")


def _test_value(test: str, env: dict[str, str | list[str]]) -> bool | None:
    """A ``[[ ... ]]`` / ``[ ... ]`` string test (==, =, !=, -z, -n) on expanded values, or None."""
    words = _words(expand(test, env))
    if any("$" in w for w in words):
        return None  # a value the expander could not resolve
    if len(words) == 3 and words[1] in ("==", "=", "!="):
        return (words[0] == words[2]) != (words[1] == "!=")
    if len(words) == 2 and words[0] in ("-z", "-n"):
        return (words[1] == "") == (words[0] == "-z")
    if len(words) == 1:
        return words[0] != ""
    return None


def condition_value(condition: str, env: dict[str, str | list[str]]) -> bool | None:
    """An ``if`` condition of string tests joined by ``||`` / ``&&`` (left to right, as bash), or None when
    it is anything else (a command, a file test): the caller then follows the ``then`` branch."""
    parts = re.split(r"\s*(\|\||&&)\s*", condition.strip())
    value: bool | None = None
    for i in range(0, len(parts), 2):
        m = _TEST_RE.fullmatch(parts[i])
        if not m:
            return None
        test = _test_value(m.group(2) if m.group(2) is not None else m.group(3), env)
        if test is None:
            return None
        test = test != bool(m.group(1))
        value = test if i == 0 else (value or test) if parts[i - 1] == "||" else (value and test)
    return value


@dataclass
class _Branch:
    outer_active: bool  # the enclosing code runs
    taken: bool = False  # an earlier branch of this if ran
    active: bool = False  # this branch runs


def _follow_branch(stmt: str, stack: list[_Branch], env: dict[str, str | list[str]]) -> bool:
    """Track if / elif / else / fi; True when ``stmt`` was one of them. A script usually builds its flags in
    branches on its own defaults (mock data or real, fp8 or not): only the branch bash would take counts."""
    active = not stack or stack[-1].active
    m = _IF_RE.fullmatch(stmt)
    if m and not m.group(1):
        value = condition_value(m.group(2), env) if active else False
        branch = _Branch(active, taken=bool(value) if value is not None else True)
        branch.active = active and (value is None or value)
        stack.append(branch)
        return True
    if not stack:
        return False
    top = stack[-1]
    if m:  # elif
        value = condition_value(m.group(2), env) if top.outer_active and not top.taken else False
        top.active = top.outer_active and not top.taken and bool(value)
        top.taken = top.taken or bool(value)
        return True
    if _ELSE_RE.fullmatch(stmt):
        top.active, top.taken = top.outer_active and not top.taken, True
        return True
    if _FI_RE.fullmatch(stmt):
        stack.pop()
        return True
    return False


def _statements(text: str) -> list[tuple[int, str]]:
    """logical_lines, with ``if ...; then`` split from a statement that follows it on the same line."""
    out = []
    for lineno, stmt in logical_lines(text):
        m = re.fullmatch(r"(\s*(?:el)?if\s+.+?;\s*then)\s+(.+)", stmt)
        if m and not re.search(r"\bfi\s*;?\s*$", stmt):
            out += [(lineno, m.group(1)), (lineno, m.group(2))]
        else:
            out.append((lineno, stmt))
    return out


def find_launch(text: str) -> Launch | None:
    env: dict[str, str | list[str]] = {}
    found: Launch | None = None
    branches: list[_Branch] = []
    for lineno, stmt in _statements(text):
        if _follow_branch(stmt, branches, env) or (branches and not branches[-1].active):
            continue
        m = _ARRAY_RE.fullmatch(stmt)
        if m:
            items = _words(expand(m.group(3), env))
            old = env.get(m.group(1), [])
            env[m.group(1)] = (list(old) if isinstance(old, list) else [old]) + items if m.group(2) else items
            continue
        m = _SCALAR_RE.fullmatch(stmt)
        if m:
            words = _words(expand(m.group(3), env)) if m.group(3) else []
            val = " ".join(words)
            if m.group(2):
                val = str(env.get(m.group(1), "")) + val
            env[m.group(1)] = val
            if "pretrain_gpt.py" not in val:
                continue
            stmt = val
        words = _words(expand(stmt, env))
        for i, w in enumerate(words):
            if w.endswith("pretrain_gpt.py"):
                args: list[str] = []
                for j, a in enumerate(words[i + 1 :], start=i + 1):
                    if a and all(ch in ";&|<>" for ch in a):
                        if args and args[-1].isdigit() and j > 0 and a.startswith(">"):
                            args.pop()
                        break
                    if re.fullmatch(r"\$\{\w+\[[@*]\]\}", a):
                        continue  # an array the script fills in a way not followed here: empty, as in bash
                    args.append(a)
                launcher = [x for x in words[:i]]
                k = max((n for n, x in enumerate(launcher) if x and all(ch in ";&|" for ch in x)), default=-1)
                found = Launch(lineno, launcher[k + 1 :], w, args, dict(env))
                break
    return found
