"""A settings section: a frozen, typed dataclass whose fields are Megatron-LM flags, each with its doc.

As in Megatron-LM core_v0.16.1's typed configs (``megatron/training/*_config.py``, turned into
arguments by ``argument_utils.ArgumentGroupFactory``) and megatron-core's ``TransformerConfig``: a
field's name is the argparse ``dest``, its default the flag's default, its type annotation the
argument's type (``X | None`` is X, ``tuple[X, ...]`` takes several values, ``Literal`` gives the
choices, ``bool`` a store_true flag, or store_false when it defaults to True), and the string
literal under it the flag's help. ``spec(...)`` says what differs from that: Megatron-LM's other
spelling of the flag, another nargs, an extension of this project, a value validation derives.

``add_section_arguments`` turns a section into an argument group; ``Section.from_values`` reads a
validated namespace into the frozen section (lists become tuples, so nothing in it can change).
Pure Python: no torch import (migrate and the planner build the parser).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import os
import textwrap
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal, TypeVar

from ...fates import FlagPolicy

EXTENSION = "[megatron-npu extension] "

S = TypeVar("S", bound="Section")


def spec(
    default: Any = None,
    *flags: str,
    extension: bool = False,
    derived: bool = False,
    opposite: tuple[str, str] | None = None,
    env_default: str | None = None,
    fates: tuple[FlagPolicy, ...] = (),
    **argparse_kwargs: Any,
) -> Any:
    """A field whose flag differs from what its name and type say.

    ``flags``: Megatron-LM's option strings when they are not ``--field-name``. ``extension``: the help
    says the flag is this project's. ``derived``: no flag of its own (validation computes the value,
    or another argument sets it). ``opposite``: ``(flag, help)`` of a second switch into the same
    dest that sets the other boolean (a legacy spelling). ``env_default``: the environment variable
    whose integer value, when set as the parser is built, is the default (``--local-rank``).
    ``fates``: what this project does with the field's flags (refused values, ignored, mapped on
    Ascend), one ``FlagPolicy`` row per option string; ``policy.py`` joins them to its own table.
    ``argparse_kwargs`` replace what the annotation infers.
    """
    for row in fates:
        assert not row.is_pattern, f"{row.flag}: a field's fate names one of its option strings"
    metadata = {
        "flags": flags,
        "extension": extension,
        "derived": derived,
        "opposite": opposite,
        "env_default": env_default,
        "fates": fates,
        "argparse": argparse_kwargs,
    }
    if isinstance(default, (list, dict, set)):
        raise TypeError("a section's default must be immutable: use a tuple")
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True, kw_only=True)
class Section:
    """Base of the settings sections: frozen (a write raises ``dataclasses.FrozenInstanceError``)."""

    @classmethod
    def from_values(cls: type[S], values: Any) -> S:
        """The section of a namespace (or a mapping, as args.json): each field by its dest."""
        read = values.get if isinstance(values, typing.Mapping) else lambda name: getattr(values, name)
        return cls(**{f.name: _immutable(read(f.name)) for f in dataclasses.fields(cls) if f.init})

    def replace(self: S, **changes: Any) -> S:
        """A copy with ``changes`` (the section itself never changes)."""
        return dataclasses.replace(self, **changes)


def _immutable(value: Any) -> Any:
    return tuple(_immutable(v) for v in value) if isinstance(value, list) else value


@cache
def field_docs(section: type) -> dict[str, str]:
    """Each field's doc: the string literal under it in the class body (as Megatron-LM documents its configs)."""
    docs: dict[str, str] = {}
    for klass in reversed(section.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
        assert isinstance(body, ast.ClassDef)
        for node, after in itertools.pairwise(body.body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def flag_fields(section: type[Section]) -> list[dataclasses.Field]:
    """The fields that have a flag of their own (not ``derived``), in the class's order."""
    return [f for f in dataclasses.fields(section) if not f.metadata.get("derived", False)]


def argument_spec(section: type[Section], field: dataclasses.Field) -> tuple[list[str], dict[str, Any]]:
    """``(option strings, add_argument kwargs)`` of one field."""
    meta = field.metadata
    flags = list(meta.get("flags") or ("--" + field.name.replace("_", "-"),))
    doc = field_docs(section).get(field.name)
    if doc is None:
        raise TypeError(f"{section.__name__}.{field.name} has no doc string")
    help_text = (EXTENSION if meta.get("extension") else "") + doc.replace("%", "%%")
    default = list(field.default) if isinstance(field.default, tuple) else field.default
    if meta.get("env_default"):
        default = int(os.getenv(meta["env_default"], str(default)))
    kwargs: dict[str, Any] = {"dest": field.name, "default": default, "help": help_text}
    overrides = meta.get("argparse", {})
    if "type" in overrides and "nargs" in overrides:
        kwargs.update(overrides)  # an annotation argparse cannot read (a value or a list of them)
        return flags, kwargs
    kind, nargs, choices = _argument_type(_type_hints(section)[field.name])
    if kind is bool:
        kwargs["action"] = "store_false" if field.default is True else "store_true"
    else:
        kwargs["type"] = kind
        if nargs is not None:
            kwargs["nargs"] = nargs
        if choices is not None:
            kwargs["choices"] = list(choices)
    kwargs.update(overrides)
    return flags, kwargs


@cache
def _type_hints(section: type[Section]) -> dict[str, Any]:
    return typing.get_type_hints(section)


def _argument_type(hint: Any) -> tuple[Any, str | None, tuple | None]:
    """(type, nargs, choices) an annotation stands for."""
    origin, parts = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        rest = [p for p in parts if p is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"{hint}: a flag takes one type (give type= in spec())")
        return _argument_type(rest[0])
    if origin is tuple:
        kind, _, choices = _argument_type(parts[0])
        return kind, "+", choices
    if origin is Literal:
        return type(parts[0]), None, parts
    return hint, None, None


def add_section_arguments(parser: argparse.ArgumentParser, section: type[Section], title: str) -> None:
    """One argument group with a flag per field of ``section`` (Megatron-LM's spellings and defaults)."""
    group = parser.add_argument_group(title=title, description=(section.__doc__ or "").split("\n")[0] or None)
    for field in flag_fields(section):
        flags, kwargs = argument_spec(section, field)
        group.add_argument(*flags, **kwargs)
        if field.metadata.get("opposite"):
            flag, help_text = field.metadata["opposite"]
            action = "store_true" if field.default is True else "store_false"
            group.add_argument(flag, action=action, dest=field.name, help=help_text)


def field_policies(sections: tuple[type[Section], ...]) -> tuple[FlagPolicy, ...]:
    """The fates the fields of ``sections`` carry, in their order."""
    return tuple(
        row for section in sections for f in dataclasses.fields(section) for row in f.metadata.get("fates", ())
    )


def field_fates(section: type[Section]) -> dict[str, tuple[FlagPolicy, ...]]:
    """dest -> the rows of the field's flags, for the fields of ``section`` that carry any."""
    return {f.name: f.metadata["fates"] for f in dataclasses.fields(section) if f.metadata.get("fates")}
