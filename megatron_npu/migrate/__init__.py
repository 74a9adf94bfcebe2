"""Megatron-LM launch script / --yaml-cfg migration: ``megatron-npu migrate`` (see cli.py).

Imports neither torch nor megatron: the rewrite is text in, text out.
"""

from __future__ import annotations

from .cli import InputError, Report, main, migrate_text
from .rules import RULES, Rule, format_rules

__all__ = ["RULES", "InputError", "Report", "Rule", "format_rules", "main", "migrate_text"]
