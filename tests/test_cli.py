"""One command-line style for every ``megatron-npu`` command: --version, help for every flag, one error form.

In-process (no launch): each command's parser is captured where its ``main`` parses, so the check covers the
parser the command really uses, subcommands included.
"""

from __future__ import annotations

import argparse
import importlib
import json

import pytest

from megatron_npu import cli
from megatron_npu.layout import rankmap, ranktable
from megatron_npu.version import __version__


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parsers(parser: argparse.ArgumentParser, name: str):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from _parsers(subparser, f"{name} {sub}")


def test_version_and_an_unknown_command(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"megatron-npu {__version__}\n"
    assert cli.main(["no-such-command"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "megatron-npu: error: unknown command 'no-such-command'"


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_every_flag_of_every_command_has_help(name, monkeypatch):
    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    with pytest.raises(_Captured) as captured:
        importlib.import_module(cli.SUBCOMMANDS[name][0]).main([])
    top = captured.value.parser
    assert top.prog == f"megatron-npu {name}" or (name == "patches" and top.prog == "megatron-npu doctor")
    for where, parser in _parsers(top, name):
        bare = [
            action.option_strings[-1] if action.option_strings else action.dest
            for action in parser._actions
            if not action.help and not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
        ]
        assert bare == [], f"megatron-npu {where}: no help for {bare}"


def test_layout_tools_take_megatron_lms_long_flag_names(capsys):
    short = ["--nnodes", "2", "--nproc-per-node", "8", "--tp", "2", "--pp", "2", "--cp", "2", "--json"]
    long = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--context-parallel-size",
        "2",
        "--json",
    ]
    assert rankmap.main(short) == 0
    by_short = capsys.readouterr().out
    assert rankmap.main(long) == 0
    assert capsys.readouterr().out == by_short
    groups = json.loads(by_short)["groups"]
    assert all(len(group) == 2 for group in groups["tp"] + groups["pp"] + groups["cp"])


def test_errors_read_megatron_npu_command_error_and_exit_2(tmp_path, capsys):
    assert rankmap.main(["--nnodes", "2", "--nproc-per-node", "8", "--tp", "16"]) == 2
    assert capsys.readouterr().err.startswith("megatron-npu rankmap: error: ")
    assert ranktable.main(["--hosts", "a", "--nic-file", str(tmp_path / "missing.txt")]) == 2
    assert capsys.readouterr().err.startswith("megatron-npu ranktable: error: ")
    with pytest.raises(SystemExit) as exit_:
        rankmap.main(["--nnodes", "x"])  # argparse's own form, with the same prefix
    assert exit_.value.code == 2 and "megatron-npu rankmap: error: argument --nnodes" in capsys.readouterr().err
    from megatron_npu.migrate import cli as migrate

    assert migrate.main([str(tmp_path / "missing.sh")]) == 2
    assert capsys.readouterr().err.startswith("megatron-npu migrate: error: cannot read ")
    assert cli.error("demo", "an example") == 2
    assert capsys.readouterr().err == "megatron-npu demo: error: an example\n"
