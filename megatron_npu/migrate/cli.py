"""``megatron-npu migrate``: a Megatron-LM launch script or --yaml-cfg file -> its NPU version.

    megatron-npu migrate train_gpt.sh [-o train_gpt.npu.sh] [--report report.json]
                         [--npus-per-node 8] [--force] [--megatron-npu-dir DIR]
    megatron-npu migrate --list-rules

Only what a rule names changes (``--list-rules``); every model, parallel, batch, schedule,
data and checkpoint value is copied byte for byte, and migrating a migrated file changes
nothing. The entry point becomes ``${MEGATRON_NPU_DIR}/pretrain_gpt.py``; the script gets
``MEGATRON_NPU_DIR=${MEGATRON_NPU_DIR:-DIR}`` where DIR is --megatron-npu-dir (default: the
checkout this package runs from), so the environment can still point it elsewhere.

Exit status: 0 when the migrated script would start; 1 when it would not (fp8 without --force,
which drops it; a layout that cannot run; flags pretrain_gpt.py refuses), each reason named on
stderr, the output written unless fp8 or (without --force) the layout refused it; 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..cli import error
from ..layout.cp_comm import placement_note
from ..layout.parallel_dims import TRAINER_FLAGS, LayoutError, ParallelDims
from ..policy import ConfigError, ignored_reason, refusal_for
from ..training import arguments
from .bash import Finding, Result, migrate_bash
from .bash_parse import find_launch
from .rules import format_rules

COMMAND = "migrate"

DEFAULT_NPU_DIR = str(Path(__file__).resolve().parents[2])
_PARALLEL = {
    "tp": ("--tensor-model-parallel-size", "tensor_model_parallel_size"),
    "pp": ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
    "cp": ("--context-parallel-size", "context_parallel_size"),
    "ep": ("--expert-model-parallel-size", "expert_model_parallel_size"),
    "etp": ("--expert-tensor-parallel-size", "expert_tensor_parallel_size"),
    "num_experts": ("--num-experts", "num_experts"),
    "vpp": ("--num-virtual-stages-per-pipeline-rank", "num_virtual_stages_per_pipeline_rank"),
    "layers_per_vstage": ("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage"),
    "num_layers": ("--num-layers", "num_layers"),
}


class InputError(ValueError):
    """The input cannot be migrated as given (unreadable, not bash, not YAML)."""


@dataclass
class Report:
    input: str
    kind: str
    result: Result
    output: str | None = None
    verdict: str = "ok"
    layout: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, str] = field(default_factory=dict)
    errors: list[Finding] = field(default_factory=list)  # make the verdict "refused"

    @property
    def refused_flags(self) -> list[str]:
        """The flags pretrain_gpt.py would refuse in the migrated launch (its parser or its validation)."""
        flags = self.checks.get("flags", "")
        if flags.startswith("not accepted: "):
            return ["does not accept " + flags.removeprefix("not accepted: ")]
        return ["refuses them: " + flags.removeprefix("rejected: ")] if flags.startswith("rejected") else []

    @property
    def starts(self) -> bool:
        """Whether the migrated script would start: nothing refused, the layout and the trainer's flags pass."""
        return not (self.result.refused or self.errors or self.refused_flags)

    def to_json(self) -> dict:
        r = self.result
        return {
            "input": self.input,
            "output": self.output,
            "kind": self.kind,
            "verdict": self.verdict,
            "starts": self.starts,
            "changes": [c.to_json() for c in r.changes],
            "unsupported": [f.to_json() for f in r.unsupported],
            "refused": [f.to_json() for f in r.refused + self.errors],
            "forced": [f.to_json() for f in r.forced],
            "notes": [f.to_json() for f in r.notes],
            "layout": self.layout,
            "checks": self.checks,
        }


def detect_kind(path: str, text: str) -> str:
    if path.endswith((".yaml", ".yml")):
        return "yaml"
    if path.endswith((".sh", ".bash")) or text.startswith("#!"):
        return "bash"
    import yaml

    try:
        return "yaml" if isinstance(yaml.safe_load(text), dict) else "bash"
    except yaml.YAMLError:
        return "bash"


def bash_syntax(text: str) -> str | None:
    """None when ``bash -n`` accepts the text, else its message (skipped without bash)."""
    if shutil.which("bash") is None:
        return None
    proc = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, timeout=30)
    if proc.returncode == 0:
        return None
    return (proc.stderr.strip().splitlines() or [f"bash -n exit {proc.returncode}"])[0]


def yaml_syntax(text: str) -> str | None:
    import yaml

    try:
        yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return str(exc).replace("\n", " ")
    return None


def _int(value: Any) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def flag_values(args: list[str]) -> dict[str, str]:
    """--flag -> its last value (Megatron's argparse keeps the last occurrence)."""
    values: dict[str, str] = {}
    for i, tok in enumerate(args):
        if tok.startswith("--") and "=" in tok:
            k, v = tok.split("=", 1)
            values[k] = v
        elif tok.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
            values[tok] = args[i + 1]
    return values


def check_layout(
    settings: dict[str, Any], nnodes: Any, nproc: Any, npus_per_node: int, report: Report, line: int | None
) -> None:
    """TP/PP/CP/EP against the launcher's ranks and the node's NPUs: the trainer's own reading of the
    flags (ParallelDims.from_args, virtual stages included) with the launch's placement rules."""
    par = {k: _int(v) for k, v in settings.items()}
    raw = {k: v for k, v in settings.items() if v is not None}
    for key, value in raw.items():
        if par[key] is None:
            report.result.unsupported.append(Finding(line, f"{key}={value}", "not a literal: layout check skipped"))
            report.checks["layout"] = "skipped (unresolved values)"
            return
    n_nodes, n_proc = _launch_size(nnodes, nproc, npus_per_node, report, line)
    report.layout = {
        **{k: par.get(k) or 1 for k in ("tp", "pp", "cp", "ep")},
        "vpp": par.get("vpp"),
        "nnodes": n_nodes,
        "nproc_per_node": n_proc,
        "npus_per_node": npus_per_node,
        "world_size": n_nodes * n_proc,
    }
    given = {dest: par[key] for key, (_, dest) in _PARALLEL.items() if par.get(key) is not None}
    flags = replace(TRAINER_FLAGS, devices_per_node="--npus-per-node")
    try:  # one ParallelDims: launcher vs the node's devices, TP in a node, world, EP, VPP, layers
        if n_nodes < 1 or n_proc < 1:
            raise LayoutError("--nnodes and --nproc-per-node must be >= 1")
        dims = ParallelDims.from_args(
            given, n_nodes * n_proc, flags, nnodes=n_nodes, nproc_per_node=n_proc, devices_per_node=npus_per_node
        )
    except LayoutError as exc:
        report.errors.append(Finding(line, "parallel layout", str(exc), "layout"))
        report.checks["layout"] = f"failed: {exc}"
        return
    report.layout["vpp"] = dims.vpp
    report.layout["dp"] = dims.dp
    report.checks["layout"] = "ok"
    cp_note = placement_note(dims.tp, dims.cp, n_proc)  # CP sits next to TP in megatron-core's rank order
    if cp_note:
        report.result.notes.append(Finding(line, "context parallel layout", cp_note, "layout"))


def _launch_size(nnodes: Any, nproc: Any, npus_per_node: int, report: Report, line: int | None) -> tuple[int, int]:
    """The launcher's node count and ranks per node; unresolvable values assumed, with a warning."""
    n_nodes, n_proc = _int(nnodes), _int(nproc)
    if n_proc is None:
        if nproc is not None:
            report.result.unsupported.append(
                Finding(line, f"nproc_per_node={nproc}", f"not resolvable; assuming {npus_per_node} (--npus-per-node)")
            )
        n_proc = npus_per_node
    if n_nodes is None:
        if nnodes is not None:
            report.result.unsupported.append(Finding(line, f"nnodes={nnodes}", "not resolvable; assuming 1"))
        n_nodes = 1
    return n_nodes, n_proc


def check_flags(args: list[str], line: int | None, world_size: int | None, report: Report, already: set[str]) -> None:
    """Flags pretrain_gpt.py does not accept, then its own validation (ConfigError) of the whole set."""
    known = arguments.known_flags()
    bad = []
    for tok in args:
        flag = tok.split("=", 1)[0]
        if not flag.startswith("--") or flag in already:
            continue
        ignored = ignored_reason(flag)
        if ignored is not None:
            report.result.notes.append(Finding(line, flag, f"accepted, no effect: {ignored}"))
        if flag in known:
            continue
        bad.append(flag)
        row = refusal_for(flag)
        why = row.message(flag) if row is not None else "pretrain_gpt.py does not accept this flag"
        report.result.unsupported.append(Finding(line, flag, why))
    if bad:
        report.checks["flags"] = "not accepted: " + " ".join(bad)
        return
    try:
        arguments.parse_args(list(args), world_size=world_size, check_paths=False)
    except ConfigError as exc:
        report.result.unsupported.append(Finding(line, "pretrain_gpt.py arguments", str(exc)))
        report.checks["flags"] = "rejected: " + str(exc)
        return
    except SystemExit as exc:  # argparse's own error exit
        report.result.unsupported.append(Finding(line, "pretrain_gpt.py arguments", f"argparse exit {exc.code}"))
        report.checks["flags"] = f"rejected (argparse exit {exc.code})"
        return
    report.checks["flags"] = "ok (parse_args accepts them)"


def migrate_text(
    text: str,
    kind: str,
    *,
    force: bool = False,
    npus_per_node: int = 8,
    npu_dir: str = DEFAULT_NPU_DIR,
    name: str = "<text>",
    keep_entry_point: bool = False,
) -> Report:
    if kind == "yaml":
        from .yamlcfg import migrate_yaml

        err = yaml_syntax(text)
        if err:
            raise InputError(f"{name}: not valid YAML: {err}")
        result = migrate_yaml(text, force=force)
    else:
        err = bash_syntax(text)
        if err:
            raise InputError(f"{name}: not valid bash (bash -n): {err}")
        result = migrate_bash(text, force=force, npu_dir=npu_dir, keep_entry_point=keep_entry_point)
    report = Report(input=name, kind=kind, result=result)
    err = yaml_syntax(result.text) if kind == "yaml" else bash_syntax(result.text)
    report.checks["syntax"] = "ok" if err is None else "failed: " + err
    if err:
        report.errors.append(Finding(None, "syntax", f"the migrated file does not parse: {err}", "syntax"))
    if kind == "yaml":
        _check_yaml(report, npus_per_node, name)
    else:
        _check_bash(report, npus_per_node, keep_entry_point)
    if result.refused or (report.errors and not force):
        report.verdict = "refused"
    elif result.unsupported or result.forced or report.errors:
        report.verdict = "ok-with-warnings"
    return report


def _check_yaml(report: Report, npus_per_node: int, name: str) -> None:
    """A migrated --yaml-cfg file: TP against a node, then the trainer's parser on the whole file."""
    import yaml

    from .yamlcfg import flatten

    result = report.result
    flat = flatten(yaml.safe_load(result.text))
    # a YAML config does not say how many nodes run it: only check that TP fits in a node
    check_layout({"tp": flat.get("tensor_model_parallel_size")}, 1, npus_per_node, npus_per_node, report, None)
    report.layout = {
        "tp": report.layout.get("tp"),
        "pp": flat.get("pipeline_model_parallel_size"),
        "npus_per_node": npus_per_node,
        "world_size": None,
    }
    if result.refused:
        return
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp, "config.yaml")
        cfg.write_text(result.text, encoding="utf-8")
        # the smallest world that runs the layout (DP=1): a YAML file names no node count
        world = 1
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            world *= _int(flat.get(key)) or 1
        check_flags(["--yaml-cfg", str(cfg)], None, world, report, set())
    for f in result.unsupported:  # name the input, not the temporary copy
        f.reason = f.reason.replace(str(cfg), name)
    report.checks["flags"] = report.checks["flags"].replace(str(cfg), name)


def _check_bash(report: Report, npus_per_node: int, keep_entry_point: bool) -> None:
    """A migrated script's launch: the layout against its launcher, then the trainer's parser."""
    result = report.result
    launch = find_launch(result.text)
    if launch is None:
        result.unsupported.append(
            Finding(None, "launch", "no command running pretrain_gpt.py was found: layout and flag checks skipped")
        )
        report.checks["layout"] = report.checks["flags"] = "skipped (no launch command)"
        return
    values = flag_values(launch.args)
    settings = {k: values.get(flag) for k, (flag, _) in _PARALLEL.items()}
    if launch.kind == "torchrun":
        nproc = launch.launcher_value("--nproc_per_node", "--nproc-per-node") or "1"
        nnodes = launch.launcher_value("--nnodes") or "1"
        check_layout(settings, nnodes, nproc, npus_per_node, report, launch.line)
        if "torch.distributed.launch" in launch.launcher:
            result.notes.append(
                Finding(
                    launch.line,
                    "python -m torch.distributed.launch",
                    "kept: deprecated by PyTorch in favour of torchrun; it passes "
                    "--local-rank, which pretrain_gpt.py accepts",
                )
            )
    elif launch.kind == "python":
        check_layout(settings, 1, 1, npus_per_node, report, launch.line)
    else:  # srun, mpirun, ...: the rank count is not in the script's literals
        check_layout({"tp": settings["tp"]}, 1, npus_per_node, npus_per_node, report, launch.line)
        report.checks["layout"] += f" (TP only: {launch.launcher[0]} launcher, world size unknown)"
        report.layout["world_size"] = None
    refused = {f.item.split()[0] for f in result.refused}
    world = report.layout.get("world_size")
    if world is None:  # unknown: the smallest world that runs the layout (DP=1)
        world = 1
        for key in ("tp", "pp", "cp"):
            world *= _int(settings.get(key)) or 1
    if keep_entry_point:  # the user's Megatron-LM parses its own flags; this trainer's parser does not apply
        report.checks["flags"] = "skipped (--keep-entry-point: Megatron-LM validates its own flags)"
    else:
        check_flags(launch.args, launch.line, world, report, refused)


def default_output(path: str) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}.npu{p.suffix}"))


def summary(report: Report) -> str:
    r = report.result
    starts = "" if report.starts else ", would not start"
    lines = [f"{report.input} ({report.kind}) -> {report.output or '(not written)'}: {report.verdict}{starts}"]
    for c in r.changes:
        what = "deleted" if c.after is None else ("added " + c.after.strip() if c.before is None else c.after.strip())
        lines.append(f"  line {c.line:4} [{c.rule}] {what}  ({c.reason})")
    for title, items in (
        ("refused", r.refused + report.errors),
        ("dropped (--force)", r.forced),
        ("unsupported", r.unsupported),
        ("notes", r.notes),
    ):
        for f in items:
            where = f"line {f.line:4}" if f.line else "         "
            lines.append(f"  {title}: {where} {f.item}: {f.reason}")
    lines.append("  checks: " + ", ".join(f"{k} {v}" for k, v in report.checks.items()))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-npu migrate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("input", nargs="?", help="a Megatron-LM launch script (bash) or --yaml-cfg file")
    p.add_argument("-o", "--output", help="where the migrated file goes (default: NAME.npu.EXT beside the input)")
    p.add_argument("--report", help="write the JSON report here")
    p.add_argument("--npus-per-node", type=int, default=8, help="NPUs per node for the layout check (default 8)")
    p.add_argument(
        "--force",
        action="store_true",
        help="drop what NPUs cannot run (fp8) and write the output even when a check fails",
    )
    p.add_argument(
        "--kind", choices=("auto", "bash", "yaml"), default="auto", help="the input's kind (default: by its name)"
    )
    p.add_argument(
        "--megatron-npu-dir",
        default=DEFAULT_NPU_DIR,
        help="default of MEGATRON_NPU_DIR written into the script (default: this checkout)",
    )
    p.add_argument(
        "--keep-entry-point",
        action="store_true",
        help="keep your own Megatron-LM pretrain_gpt.py: the launcher runs it as -m megatron_npu.run SCRIPT "
        "(patched, unmodified) instead of this project's pretrain_gpt.py",
    )
    p.add_argument("--list-rules", action="store_true", help="print the rules and their reasons")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the summary")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_rules:
        print(format_rules())
        return 0
    if not args.input:
        return error(COMMAND, "give INPUT (or --list-rules)")
    if args.npus_per_node < 1:
        return error(COMMAND, "--npus-per-node must be >= 1")
    try:
        text = Path(args.input).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return error(COMMAND, f"cannot read {args.input}: {exc.strerror if isinstance(exc, OSError) else exc}")
    kind = detect_kind(args.input, text) if args.kind == "auto" else args.kind
    try:
        report = migrate_text(
            text,
            kind,
            force=args.force,
            npus_per_node=args.npus_per_node,
            npu_dir=args.megatron_npu_dir,
            name=args.input,
            keep_entry_point=args.keep_entry_point,
        )
    except InputError as exc:
        return error(COMMAND, str(exc))
    if report.verdict != "refused":
        report.output = args.output or default_output(args.input)
        Path(report.output).write_text(report.result.text, encoding="utf-8")
    if args.report:
        Path(args.report).write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report.to_json(), indent=2) if args.json else summary(report))
    if report.starts:
        return 0
    fp8 = [f.item for f in report.result.refused]
    if fp8:
        error(COMMAND, f"fp8 is not supported on the Ascend 910B: {', '.join(fp8)} (--force drops them)")
    for f in report.errors:
        error(COMMAND, f"{f.item}: {f.reason}")
    for flags in report.refused_flags:
        error(COMMAND, f"the migrated script would not start: pretrain_gpt.py {flags}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
