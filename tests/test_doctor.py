"""`megatron-npu doctor --json` reports target, backend, versions and the patches."""

import json
import subprocess
import sys

from distributed import ROOT, base_env


def test_doctor_json_lists_device_backend_versions_and_patches():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_npu", "doctor", "--json"],
        env=base_env(), cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    report = json.loads(out)
    assert report["device"] == "cpu" and report["backend"] == "gloo"
    assert report["versions"]["megatron_core"].startswith("0.16")
    subsystems = {p["subsystem"] for p in report["patches"] if p["state"] != "inactive"}
    assert {"device_arguments", "torch_cuda", "distributed", "tensor_parallel", "optimizer"} <= subsystems
    for row in report["patches"]:
        assert row["reason"] and ":" in row["target"] and row["megatron_core"]
