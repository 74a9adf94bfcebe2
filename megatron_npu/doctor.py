"""``megatron-npu doctor``: what this process would run on, and how.

Reports the target, the collective backend, versions (torch, torch_npu,
megatron-core, CANN), every applied patch with its reason, and warnings.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from typing import Any

from .accelerator import DEVICE_ENVVAR, get_accelerator
from .registry import REGISTRY
from .version import TESTED_MEGATRON_CORE, __version__, installed_megatron_core


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect() -> dict[str, Any]:
    """The doctor's findings as a JSON-ready dict."""
    import megatron_npu

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
        "megatron_core": megatron,
        "megatron_core_tested": str(TESTED_MEGATRON_CORE),
        **accelerator.versions(),
    }
    if accelerator.device_type == "cpu" and os.environ.get(DEVICE_ENVVAR, "auto") == "auto":
        warnings.append("no NPU or GPU found: running on the cpu target (gloo)")
    visible = os.environ.get(accelerator.visible_devices_envvar)
    from . import patches as patch_set  # noqa: F401  (registers the patch set)

    applied = {patch.name for patch in megatron_npu.applied_patches()}
    pending = {patch.name for patch in REGISTRY.pending()}
    patch_rows = [
        {
            "name": patch.name,
            "subsystem": patch.subsystem,
            "target": patch.target,
            "reason": patch.reason,
            "megatron_core": patch.megatron_versions,
            "requires": patch.requires,
            "state": "applied" if patch.name in applied else "pending" if patch.name in pending else "inactive",
            "aliases_replaced": REGISTRY.alias_count(patch.name),
        }
        for patch in REGISTRY.patches
    ]
    return {
        "device": accelerator.device_type,
        "backend": accelerator.communication_backend,
        "device_count": accelerator.device_count() if accelerator.device_type != "cpu" else 0,
        "visible_devices": {accelerator.visible_devices_envvar: visible},
        "fused_ops": accelerator.fused_ops(),
        "versions": versions,
        "patches": patch_rows,
        "warnings": warnings,
    }


def render(report: dict[str, Any], patches_only: bool = False) -> str:
    lines = []
    if not patches_only:
        lines += [
            f"device   : {report['device']}",
            f"backend  : {report['backend']}",
            "versions : " + ", ".join(f"{k}={v}" for k, v in report["versions"].items() if v),
            "fused ops: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in report["fused_ops"].items()),
        ]
    rows = report["patches"]
    by_subsystem: dict[str, int] = {}
    for row in rows:
        if row["state"] != "inactive":
            by_subsystem[row["subsystem"]] = by_subsystem.get(row["subsystem"], 0) + 1
    active = sum(by_subsystem.values())
    lines.append(f"patches  : {active} active of {len(rows)} ({', '.join(f'{k} {v}' for k, v in by_subsystem.items())})")
    for row in rows:
        if row["state"] == "inactive":
            continue
        aliases = f" (+{row['aliases_replaced']} aliases)" if row["aliases_replaced"] else ""
        lines.append(f"  [{row['state']:7}] {row['target']}{aliases}\n            {row['reason']}")
    lines += [f"warning  : {warning}" for warning in report["warnings"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-npu doctor", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--patches", action="store_true", help="list the patches only")
    args = parser.parse_args(argv)
    report = collect()
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(report, patches_only=args.patches))
    return 0
