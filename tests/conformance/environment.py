"""The packages megatron-core's suite imports that upstream's test environment installs and this project does not
depend on: checked before a run, and named in one line when missing (their tests then fail: unexpected, but where
expected.ENVIRONMENT_LIMITS names the package as a need this machine lacks)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

EXTRA = "pip install -e '.[conformance]'"
#: import name -> how upstream's environment gets it (Megatron-LM core_v0.16.1's pyproject.toml, dev / lts extras).
TEST_PACKAGES = {
    # megatron.core.optimizer.muon (dist_checkpointing/test_layer_wise_optimizer.py: optimizer='dist_muon').
    # Not on PyPI: Megatron-LM pins the tag in [tool.uv.sources]; installed without dependencies (torch, absl-py
    # and typing-extensions are here already).
    "emerging_optimizers": "pip install --no-deps git+https://github.com/NVIDIA-NeMo/Emerging-Optimizers.git@v0.1.0",
    # Megatron-LM's megatron.rl server, imported by megatron.rl.rl_utils (models/test_gpt_model_batch_invariant.py)
    # test_utils.py (top level) imports the mock backport (Megatron-LM's dev dependencies)
    "mock": EXTRA,
    # megatron.core.inference's data-parallel coordinator (inference/test_data_parallel_inference_coordinator.py
    # imports it at module level; megatron-core names the same command when it is missing)
    "msgpack": EXTRA,
    # pytest's asyncio plugin (Megatron-LM's dev dependencies): inference/engines/test_static_engine.py::test_streaming
    # is an async test. A plugin loads in every pytest session of its environment: install the extra in a venv.
    "pytest_asyncio": EXTRA,
    # the inference coordinator's transport (inference/test_data_parallel_inference_coordinator.py skips without it)
    "zmq": EXTRA,
    # Megatron-LM's text-generation server (top-level test_inference.py is skipped at import without it)
    "flask_restful": EXTRA,
    # NVIDIA's NVTX annotations: megatron.core.utils imports it if present; test_utils.py::test_nvtx_decorator needs it
    # (nvtx.annotate is a no-op without a profiler attached, so it runs on any host)
    "nvtx": EXTRA,
    "fastapi": EXTRA,
    "uvicorn": EXTRA,
}


def missing_test_packages(find: Callable[[str], object] = importlib.util.find_spec) -> dict[str, str]:
    """Import name -> install command, for each test package not importable here."""
    return {name: how for name, how in TEST_PACKAGES.items() if find(name) is None}


def missing_line(missing: dict[str, str]) -> str:
    """One line naming what is missing and how to install it, grouped by command ('' when nothing is)."""
    if not missing:
        return ""
    by_command: dict[str, list[str]] = {}
    for name, how in missing.items():
        by_command.setdefault(how, []).append(name)
    parts = [f"{', '.join(names)} ({how})" for how, names in by_command.items()]
    return "conformance: test packages not installed, their tests will fail (install them): " + "; ".join(parts)


def missing_tools_line(missing: list[str], tag: str) -> str:
    """One line naming the Megatron-LM files the shared extracts lack and how to supply them ('' when none is)."""
    if not missing:
        return ""
    return (
        f"conformance: Megatron-LM files not in the shared extracts, their tests will fail as environment limits: "
        f"{', '.join(missing)} (--megatron-lm PATH or CONFORMANCE_MEGATRON_LM=PATH: a Megatron-LM {tag} "
        f"checkout or git clone)"
    )
