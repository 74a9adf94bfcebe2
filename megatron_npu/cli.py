"""The ``megatron-npu`` command: one subcommand per tool.

Each subcommand lives in its own module as ``main(argv) -> int``; this table is
the only place that names them, so ``megatron-npu --help`` lists them all.

This process does not patch at import (``megatron_npu.launched_by_command``): ``main``
applies the patch layer, as ``import megatron_npu`` does elsewhere (``MEGATRON_NPU_AUTOPATCH``
honoured), before the subcommands marked ``PATCHED``: those that run or report on
megatron-core. The others (preprocessing, layout tools, migrate, perf-report) start without
torch unless their own work needs it.
"""

from __future__ import annotations

import importlib
import os
import sys

import megatron_npu

PATCHED = frozenset({"demo", "doctor", "patches", "convert"})
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("megatron_npu.demo", "doctor, then a small GPT trained with TP2 x PP2 (4 ranks)"),
    "doctor": ("megatron_npu.doctor", "target, backend, versions and the applied patches"),
    "preprocess": ("megatron_npu.data.preprocess", "jsonl -> Megatron .bin/.idx (preprocess_data.py flags)"),
    "patches": ("megatron_npu.doctor", "list the patch set (alias of doctor --patches)"),
    "migrate": (
        "megatron_npu.migrate.cli",
        "Megatron-LM launch script / --yaml-cfg -> NPU (--list-rules for the rules)",
    ),
    "rankmap": ("megatron_npu.layout.rankmap", "rank -> node/device and TP/PP/DP/CP groups; refuses TP across nodes"),
    "plan": ("megatron_npu.plan.cli", "communication and memory per rank; --search: the layouts that fit"),
    "ranktable": ("megatron_npu.layout.ranktable", "HCCL rank table (RANK_TABLE_FILE) from hosts and NPU NIC ips"),
    "convert": (
        "megatron_npu.convert.cli",
        "Hugging Face model <-> pretrain_gpt.py checkpoint (to-megatron / to-hf); prints the model's flags",
    ),
    "perf-report": (
        "megatron_npu.perf.report",
        "five-point health check of a run: comm share, node traffic, balance, data loader, grad reduce",
    ),
}


#: Exit status of a command given bad flags or bad input (argparse's own), with one line on stderr.
USAGE_ERROR = 2


def error(command: str, message: str) -> int:
    """Print the one error line every command uses, ``megatron-npu COMMAND: error: MESSAGE``; return 2.

    argparse writes the same form for a bad flag when the parser's prog is ``megatron-npu COMMAND``."""
    print(f"megatron-npu {command}: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def _usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = ["usage: megatron-npu [--version] COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    lines += ["", "megatron-npu COMMAND --help: its flags. Errors exit 2; see docs/cli.md for each command's codes."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from megatron_npu.version import __version__

        print(f"megatron-npu {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(_usage(), file=sys.stderr)
        print(f"megatron-npu: error: unknown command {name!r}", file=sys.stderr)
        return USAGE_ERROR
    if name in PATCHED:
        megatron_npu.quiet_expected_fallbacks()
        if megatron_npu.autopatch_enabled():
            megatron_npu.patch()
    else:
        megatron_npu.quiet_expected_fallbacks(ask_accelerator=False)  # asking would import torch
    module = importlib.import_module(SUBCOMMANDS[name][0])
    if name == "patches":
        rest = ["--patches", *rest]
    try:
        return int(module.main(rest) or 0)
    except BrokenPipeError:  # the reader stopped early (`| head`): not an error of the command
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 0


if __name__ == "__main__":
    sys.exit(main())
