"""``megatron-npu doctor``: what this process would run on, and how.

Reports the target, the collective backend, versions (torch, torch_npu,
megatron-core, CANN), every applied patch with its reason, and warnings.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from datetime import timedelta
from typing import Any

from .accelerator import DEVICE_ENVVAR, get_accelerator
from .accelerator.facts import TESTED_TORCH_NPU
from .policy import env_policy
from .registry import REGISTRY, Patch
from .version import TESTED_MEGATRON_CORE, __version__, installed_megatron_core


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def foreign_environment(environ: dict[str, str] | None = None) -> list[dict[str, str]]:
    """Set CUDA/NCCL variables and what the Ascend mapping (policy.ENV_POLICY) makes of them."""
    environ = dict(os.environ if environ is None else environ)
    rows = []
    for name in sorted(environ):
        row = env_policy(name)
        if row is not None:
            rows.append({"name": name, "action": row.action, "to": row.to, "reason": row.reason})
    return rows


#: Megatron-LM's --distributed-timeout-minutes default
DEFAULT_TIMEOUT_MINUTES = 10


def collective_timeouts(accelerator: Any, minutes: float, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The timeouts a rank runs with: the process group's, and the collective library's own variables
    (the accelerator's collective_timeout_environment): exported by the user, else set from the flag."""
    environ = dict(os.environ if environ is None else environ)
    from_flag = accelerator.collective_timeout_environment(timedelta(minutes=minutes), {})
    variables = {
        name: {"value": environ.get(name, value), "source": "exported" if name in environ else "flag"}
        for name, value in from_flag.items()
    }
    return {"distributed_timeout_minutes": minutes, "variables": variables}


def collect(timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> dict[str, Any]:
    """The doctor's findings as a JSON-ready dict."""

    accelerator = get_accelerator()
    warnings: list[str] = []
    if not REGISTRY.active and not accelerator.is_upstream:
        warnings.append("patches are not applied: call megatron_npu.patch() before megatron-core runs")
    megatron = installed_megatron_core()
    versions = {
        "python": platform.python_version(),
        "megatron_npu": __version__,
        "torch": _version("torch"),
        "torch_npu": _version("torch_npu"),
        "torch_npu_tested": TESTED_TORCH_NPU,
        "megatron_core": megatron,
        "megatron_core_tested": str(TESTED_MEGATRON_CORE),
        **accelerator.versions(),
    }
    if accelerator.runs_on_host and os.environ.get(DEVICE_ENVVAR, "auto") == "auto":
        warnings.append("no NPU or GPU found: running on the cpu target (gloo)")
    visible = os.environ.get(accelerator.visible_devices_envvar)
    environment = foreign_environment()
    if accelerator.stands_in_for_cuda:  # CUDA/NCCL settings do not reach a target standing in for CUDA
        for row in environment:
            if row["action"] in ("rename", "convert", "comment"):
                to = f": set {row['to']}" if row["to"] else ""
                warnings.append(f"{row['name']} has no effect on {accelerator.name}{to} ({row['reason']})")
    from . import patches as patch_set  # noqa: F401  (registers the patch set)

    resolve_targets()
    patch_rows = [
        {
            "name": patch.name,
            "subsystem": patch.subsystem,
            "target": patch.target,
            "reason": patch.reason,
            "megatron_core": patch.megatron_versions,
            "requires": patch.requires,
            "state": patch_state(patch),
            "aliases_replaced": REGISTRY.alias_count(patch.name),
        }
        for patch in REGISTRY.patches
    ]
    megatron_lm = megatron_lm_report(patch_rows)
    if megatron_lm["importable"] and not megatron_lm["tested"]:
        warnings.append(megatron_lm["error"])
    return {
        "device": accelerator.device_type,
        "backend": accelerator.communication_backend,
        "device_count": 0 if accelerator.runs_on_host else accelerator.device_count(),
        "visible_devices": {accelerator.visible_devices_envvar: visible},
        "fused_ops": accelerator.fused_ops(),
        "fused_attention": fused_attention_report(),
        "timeouts": collective_timeouts(accelerator, timeout_minutes),
        "environment": environment,
        "versions": versions,
        "patches": patch_rows,
        "megatron_lm": megatron_lm,
        "patches_for_release": REGISTRY.release,
        "errors": list(REGISTRY.missing().values()),
        "warnings": warnings,
    }


#: States of a patch in the report. applied: in place; pending: its module is not imported in this process
#: (megatron/training without a checkout on the path); missing: its target does not exist in a release the
#: patch claims (an error: exit 1); other-release: verified for other megatron-core releases, not applied;
#: inactive: the target (accelerator) does not need it.
STATES = ("applied", "pending", "missing", "other-release", "inactive")


def patch_state(patch: Patch) -> str:
    if not REGISTRY.active or not patch.applies_to(get_accelerator()):
        return "inactive"
    if patch in REGISTRY.other_release():
        return "other-release"
    if patch.name in REGISTRY.missing():
        return "missing"
    return "applied" if patch in REGISTRY.applied() else "pending"


def installed_optional_packages() -> tuple[str, ...]:
    """The top-level packages outside megatron and torch that pending targets live in and that are installed here
    (an optional package megatron-core imports, e.g. for one optimizer): looked up when present, pending when not."""
    tops = {name.split(".")[0] for name in (patch.module_name for patch in REGISTRY.pending())}
    return tuple(sorted(top for top in tops - {"megatron", "torch"} if importlib.util.find_spec(top) is not None))


def resolve_targets() -> None:
    """Look every pending target up now: megatron-core's and torch's modules are imported (the doctor reports on
    megatron-core), megatron/training's when a checkout of a verified tag is importable, an optional package's
    when it is installed."""
    from .version import UnsupportedMegatronVersion, check_megatron_lm

    if not REGISTRY.active:
        return
    prefixes: tuple[str, ...] = ("megatron.core", "torch", *installed_optional_packages())
    try:
        check_megatron_lm()
        prefixes += ("megatron.training",)
    except UnsupportedMegatronVersion:
        pass  # no checkout, or another release: megatron_lm_report says which
    REGISTRY.resolve(prefixes)


def megatron_lm_report(patch_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Is a Megatron-LM training stack (megatron/training) importable, which release, which patches apply."""
    from .version import (
        TESTED_MEGATRON_LM,
        TESTED_MEGATRON_LM_RANGE,
        UnsupportedMegatronVersion,
        check_megatron_lm,
        installed_megatron_lm,
        megatron_lm_tag,
    )

    found = installed_megatron_lm()  # read from files: megatron.training is not imported
    training_patches = [row for row in patch_rows if row["subsystem"] == "megatron_training"]
    report: dict[str, Any] = {
        "importable": found is not None,
        "version": found[0] if found else None,
        "version_source": found[1] if found else None,
        "path": found[2] if found else None,
        "tested_release": megatron_lm_tag() or TESTED_MEGATRON_LM,
        "tested": None,  # True / False once a training stack is found
        "tested_range": TESTED_MEGATRON_LM_RANGE,
        "megatron_core": installed_megatron_core(),
        # pending: applied by the import hook when the script imports megatron.training
        "patches": {row["name"]: row["state"] for row in training_patches},
        "error": None,
    }
    if found is not None:
        try:
            check_megatron_lm()
            report["tested"] = True
        except UnsupportedMegatronVersion as error:
            report["tested"], report["error"] = False, str(error)
    return report


def fused_attention_report() -> dict[str, Any]:
    """What --use-flash-attn runs on the device's fused attention, and what falls back to megatron-core's
    unfused math (with why): ops/attention.py's lists."""
    from megatron_npu.ops.attention import FUSED_ATTENTION_COVERS, FUSED_ATTENTION_FALLS_BACK

    return {"covers": list(FUSED_ATTENTION_COVERS), "falls_back": dict(FUSED_ATTENTION_FALLS_BACK)}


def render(report: dict[str, Any], patches_only: bool = False) -> str:
    lines = []
    if not patches_only:
        lines += [
            f"device   : {report['device']}",
            f"backend  : {report['backend']}",
            "versions : " + ", ".join(f"{k}={v}" for k, v in report["versions"].items() if v),
            "fused ops: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in report["fused_ops"].items()),
            "fused attention (--use-flash-attn): " + "; ".join(report["fused_attention"]["covers"]),
            *(
                f"  falls back to megatron-core's math: {what} ({why})"
                for what, why in report["fused_attention"]["falls_back"].items()
            ),
            render_timeouts(report["timeouts"]),
        ]
        for row in report["environment"]:
            on_ascend = (
                f"{row['to']} on Ascend"
                if row["to"]
                else {"comment": "no Ascend counterpart"}.get(row["action"], "kept on Ascend")
            )
            lines.append(f"env      : {row['name']} -> {on_ascend} ({row['reason']})")
    lm = report.get("megatron_lm")
    if lm is not None and not patches_only:
        if lm["importable"]:
            active = sum(1 for state in lm["patches"].values() if state in ("applied", "pending", "missing"))
            lines.append(
                f"megatron-lm: {lm['version']} at {lm['path']} (from {lm['version_source']}); "
                f"megatron-core {lm['megatron_core']}; tested with {lm['tested_release']}: "
                f"{'yes' if lm['tested'] is True else 'NO'}; "
                f"{active} of {len(lm['patches'])} megatron_training patches apply"
            )
        else:
            lines.append("megatron-lm: no megatron/training importable (this project's pretrain_gpt.py needs none)")
    lines += render_patches(report)
    lines += [f"warning  : {warning}" for warning in report["warnings"]]
    lines += [f"error    : {error}" for error in report["errors"]]
    lines.append(f"verdict  : {verdict(report)}")
    return "\n".join(lines)


def verdict(report: dict[str, Any]) -> str:
    """One line: whether runs start on this machine, on which target, and what to look at first."""
    if report["errors"]:
        return (
            f"NOT READY: {len(report['errors'])} patch target(s) missing in megatron-core "
            f"{report['versions'].get('megatron_core')} (the error lines above); use a tested release"
        )
    versions = report["versions"]
    where = f"target {report['device']} ({report['backend']}"
    where += f", {report['device_count']} devices)" if report["device_count"] else ")"
    notes = []
    if versions.get("torch_npu") and versions["torch_npu"] != versions.get("torch_npu_tested"):
        notes.append(f"torch_npu {versions['torch_npu']} is not the tested {versions['torch_npu_tested']}")
    if report["warnings"]:
        notes.append(f"{len(report['warnings'])} warning(s) above")
    return f"ready: {where}" + (f"; {'; '.join(notes)}" if notes else "")


def render_timeouts(timeouts: dict[str, Any]) -> str:
    minutes = timeouts["distributed_timeout_minutes"]
    flag = f"--distributed-timeout-minutes {minutes:g}"
    said = {"exported": "exported", "flag": f"from {flag}"}
    own = [f"{name}={row['value']} s ({said[row['source']]})" for name, row in timeouts["variables"].items()]
    return f"timeouts : process groups {minutes:g} min ({flag}); " + (
        ", ".join(own) if own else "the collective library waits on the process groups' timeout alone"
    )


def render_patches(report: dict[str, Any]) -> list[str]:
    """The patches for the installed megatron-core, then the ones verified only for other releases."""
    rows = report["patches"]
    by_subsystem: dict[str, int] = {}
    for row in rows:
        if row["state"] in ("applied", "pending", "missing"):
            by_subsystem[row["subsystem"]] = by_subsystem.get(row["subsystem"], 0) + 1
    release = report.get("patches_for_release") or report["versions"].get("megatron_core")
    lines = [
        f"patches  : {sum(by_subsystem.values())} for megatron-core {release} of {len(rows)} "
        f"({', '.join(f'{k} {v}' for k, v in by_subsystem.items())})"
    ]
    for row in rows:
        if row["state"] in ("applied", "pending", "missing"):
            aliases = f" (+{row['aliases_replaced']} aliases)" if row["aliases_replaced"] else ""
            lines.append(f"  [{row['state']:7}] {row['target']}{aliases}\n            {row['reason']}")
    others = [f"{row['name']} ({row['megatron_core']})" for row in rows if row["state"] == "other-release"]
    if others:
        lines.append(f"  not for megatron-core {release}: {', '.join(others)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-npu doctor", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--patches", action="store_true", help="list the patches only")
    parser.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=DEFAULT_TIMEOUT_MINUTES,
        help="the run's flag: the collective timeouts shown are those a rank of that run gets",
    )
    args = parser.parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr):  # modules imported to look targets up may print: keep stdout JSON
        report = collect(args.distributed_timeout_minutes)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(report, patches_only=args.patches))
    return 1 if report["errors"] else 0  # a patch whose target is missing in a release it claims
