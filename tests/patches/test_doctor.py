"""`megatron-npu doctor --json` reports target, backend, versions and the patches."""

import importlib.util
import json
import subprocess
import sys

import pytest
from distributed import ROOT, base_env
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megatron_npu.accelerator.cpu import CpuAccelerator


@pytest.mark.launch
def test_doctor_json_lists_device_backend_versions_and_patches():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_npu", "doctor", "--json"],
        env=base_env(NCCL_SOCKET_IFNAME="eth0"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,  # megatron-core imported whole (every target looked up): ~8 s CPU, minutes on a loaded machine
        check=True,
    ).stdout
    report = json.loads(out)
    assert report["device"] == "cpu" and report["backend"] == "gloo" and report["device_count"] == 0
    assert report["versions"]["megatron_core"].startswith("0.16")
    subsystems = {p["subsystem"] for p in report["patches"] if p["state"] != "inactive"}
    assert {"device_arguments", "torch_cuda", "distributed", "tensor_parallel", "optimizer"} <= subsystems
    cpu = CpuAccelerator()
    installed = Version(report["versions"]["megatron_core"])
    for row in report["patches"]:
        module, _, attribute = row["target"].partition(":")
        assert row["reason"] and module and attribute, row
        # active exactly when the cpu target has the capability the patch requires
        assert (row["state"] != "inactive") == cpu.capability(row["requires"]), row
        assert row["state"] in ("applied", "pending", "other-release", "inactive"), row  # never "missing"
        if row["state"] != "inactive":  # listed as another release's exactly when its range excludes this one
            assert (row["state"] == "other-release") == (installed not in SpecifierSet(row["megatron_core"])), row
    assert report["errors"] == [] and report["patches_for_release"] == report["versions"]["megatron_core"]
    # megatron-core's targets (and an installed optional package's) are looked up by the doctor itself: only
    # megatron/training's wait for a checkout, and those in an optional package that is not installed here
    for row in report["patches"]:
        if row["state"] == "pending" and row["subsystem"] != "megatron_training":
            assert importlib.util.find_spec(row["target"].split(".")[0].split(":")[0]) is None, row
    # the Ascend environment mapping (megatron_npu/policy.py) names a set NCCL variable
    assert {
        "name": "NCCL_SOCKET_IFNAME",
        "action": "rename",
        "to": "HCCL_SOCKET_IFNAME",
        "reason": "HCCL bootstrap NIC, same ^/= syntax",
    } in report["environment"]


def _checkout(root, package_info: str | None):
    (root / "megatron" / "training").mkdir(parents=True)
    (root / "megatron" / "training" / "__init__.py").write_text("")
    if package_info is not None:
        (root / "megatron" / "core").mkdir()
        (root / "megatron" / "core" / "package_info.py").write_text(package_info)
    return root


def test_doctor_reports_the_megatron_lm_training_stack_its_version_and_patches(tmp_path, monkeypatch):
    import importlib

    from megatron_npu import doctor
    from megatron_npu.version import installed_megatron_core, megatron_lm_tag

    rows = [
        {"name": "megatron.training.x", "subsystem": "megatron_training", "state": "pending"},
        {"name": "torch.cuda.y", "subsystem": "torch_cuda", "state": "applied"},
    ]
    assert doctor.megatron_lm_report(rows)["importable"] is False  # this project needs no megatron/training

    other = _checkout(tmp_path / "other", "MAJOR = 0\nMINOR = 15\nPATCH = 2\nPRE_RELEASE = ''\n")
    monkeypatch.syspath_prepend(str(other))
    importlib.invalidate_caches()
    report = doctor.megatron_lm_report(rows)
    assert report["importable"] and report["version"] == "0.15.2" and report["tested"] is False
    assert "0.15.2" in report["error"] and megatron_lm_tag() in report["error"]  # core_v0.16.1 beside 0.16.1
    assert report["patches"] == {"megatron.training.x": "pending"}

    extract = _checkout(tmp_path / "extract", None)  # no megatron/core: runs against the wheel
    monkeypatch.syspath_prepend(str(extract))
    importlib.invalidate_caches()
    report = doctor.megatron_lm_report(rows)
    assert report["path"] == str(extract) and report["version"] == installed_megatron_core()
    assert report["tested"] is True and report["error"] is None
