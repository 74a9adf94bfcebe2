"""What happens to a Megatron-LM flag here (``FlagPolicy``), and the errors bad settings raise.

The row type of ``policy.py``'s table and of the settings sections' fields: a flag that is a field
carries its fate in the field (``sections/base.py:spec(fates=...)``); ``policy.py`` holds the rows
of the flags that are not fields and joins both into the one table everyone reads. Pure Python.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Literal

Outcome = Literal["refused", "ignored", "mapped"]
#: "device": impossible on Ascend in any trainer (upstream Megatron-LM's too);
#: "trainer": this project's trainer does not have it (Megatron-LM's own may).
Scope = Literal["device", "trainer"]
MigrateAction = Literal["drop", "ask", "rewrite", "replace", "note", ""]


class ConfigError(ValueError):
    """A bad configuration; the message names the flags to change."""


@dataclass(frozen=True)
class Accepted:
    """How pretrain_gpt.py's parser takes an ignored flag that nothing else reads: Megatron-LM
    core_v0.16.1's action, type and default (training/arguments.py adds one argument per row)."""

    action: Literal["store_true", "store_false", "store"]
    type: type | None = None
    default: Any = None
    nargs: str | None = None

    def argparse_kwargs(self) -> dict[str, Any]:
        if self.action != "store":
            return {"action": self.action}
        kwargs: dict[str, Any] = {"type": self.type, "default": self.default}
        if self.nargs is not None:
            kwargs.update(nargs=self.nargs, default=list(self.default or ()))
        return kwargs


TRUE = Accepted("store_true")
FALSE = Accepted("store_false")


def takes(kind: type, default: Any = None, nargs: str | None = None) -> Accepted:
    return Accepted("store", kind, default, nargs)


@dataclass(frozen=True)
class FlagPolicy:
    """What happens to one Megatron-LM flag (an option string or an fnmatch pattern)."""

    flag: str
    outcome: Outcome
    reason: str
    alternative: str = ""
    #: refused: the values still accepted (None: refused whenever given);
    #: mapped: the values the mapping is about (None: any).
    allowed: tuple[str, ...] | None = None
    migrate: MigrateAction = ""
    #: migrate's rule name (reports, ``--list-rules``); "" for rows migrate copies.
    name: str = ""
    rewrite: str = ""  # migrate="rewrite": "old=new"; migrate="replace": the flag given instead
    takes_value: bool = False  # migrate drops the flag's value with it
    scope: Scope = "trainer"
    #: ignored: how the trainer's parser accepts the flag, where no other argument defines it
    accepted: Accepted | None = None

    @property
    def is_pattern(self) -> bool:
        return any(c in self.flag for c in "*?[")

    def matches(self, flag: str) -> bool:
        return fnmatch.fnmatchcase(flag, self.flag) if self.is_pattern else flag == self.flag

    def message(self, given: str | None = None, value: Any = None) -> str:
        """The trainer's one-line refusal: ``--flag [value] is not supported: why; instead``."""
        what = given or self.flag
        if self.allowed is not None and value is not None:
            what = f"{what} {value_str(value)}"
        return f"{what} is not supported: {self.reason}; {self.alternative}"


# Reasons several rows share.
TE = "Transformer Engine is CUDA-only"
CUDA_GRAPH = "CUDA graphs are CUDA-only"
DEEPEP = "the flex dispatcher runs on DeepEP / HybridEP, CUDA-only kernels"
DROP = "drop the flag"
NO_HISTORY = "no allocator history is recorded"


def value_str(value: Any) -> str:
    """A flag's value as the command line spells it (lists space-separated)."""
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def check_value(policy: FlagPolicy, value: Any) -> None:
    """Raise ConfigError when a refused flag with allowed values has another value (None: unset)."""
    if policy.outcome == "refused" and policy.allowed is not None and value is not None:
        if value_str(value) not in policy.allowed:
            raise ConfigError(policy.message(policy.flag, value))
