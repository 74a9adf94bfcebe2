"""Import hooks of the npu emulation (installed by sitecustomize.py when MEGATRON_NPU_EMULATE=1).

``torch_npu`` is answered with the reference operators (tests/accelerator/npu_reference.py), each call counted by
kind; ``megatron_npu.accelerator.npu`` runs unchanged and then has its ``NpuAccelerator`` mapped onto the host
(host_mapping.py). Nothing is imported before a process asks for one of the two modules.
"""

from __future__ import annotations

import atexit
import collections
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
REFERENCE = HERE.parent / "accelerator" / "npu_reference.py"
ACCELERATOR_MODULE = "megatron_npu.accelerator.npu"
LOG_ENVVAR = "MEGATRON_NPU_EMULATION_LOG"

#: "operator kind" -> calls in this process
CALLS: collections.Counter[str] = collections.Counter()


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _mask_kind(mask: Any) -> str:
    """none, compressed (the 2048 x 2048 triangle), causal (the plain upper triangle) or document (anything else)."""
    if mask is None:
        return "none"
    import torch

    sq, sk = mask.shape[-2:]
    if (sq, sk) == (2048, 2048):
        return "compressed"
    causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu(diagonal=1)
    return "causal" if bool((mask.bool() == causal).all()) else "document"


def _kind(name: str, args: tuple, kwargs: dict) -> str:
    if name in ("npu_fusion_attention", "npu_fusion_attention_grad"):
        mode = kwargs.get("sparse_mode", 0)
        return f"{name} sparse_mode={mode} mask={_mask_kind(kwargs.get('atten_mask'))}"
    if name == "npu_grouped_matmul":
        return f"{name} group_type={kwargs.get('group_type')} group_list_type={kwargs.get('group_list_type')}"
    return name


def _counted(name: str, operator: Any) -> Any:
    @functools.wraps(operator)
    def call(*args: Any, **kwargs: Any) -> Any:
        CALLS[_kind(name, args, kwargs)] += 1
        return operator(*args, **kwargs)

    return call


class _TorchNpuLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        reference = _load("npu_reference", REFERENCE)
        module = reference.build_torch_npu()
        for name, operator in reference.OPERATORS.items():
            setattr(module, name, _counted(name, operator))
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Built in create_module."""


class _HostMappedAccelerator(importlib.abc.Loader):
    """Runs megatron_npu/accelerator/npu.py as it is, then maps its NpuAccelerator onto the host."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        host_mapping = _load("npu_emulation_host_mapping", HERE / "host_mapping.py")
        module.NpuAccelerator = host_mapping.host_mapped(module.NpuAccelerator)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torch_npu":
            return importlib.util.spec_from_loader("torch_npu", _TorchNpuLoader())
        if fullname != ACCELERATOR_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                spec.loader = _HostMappedAccelerator(spec.loader)
                return spec
        return None


def _write_calls() -> None:
    folder, rank = os.environ.get(LOG_ENVVAR), os.environ.get("RANK")
    if folder and rank is not None and "torch_npu" in sys.modules:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps(dict(CALLS), sort_keys=True))


def install() -> None:
    sys.meta_path.insert(0, _Finder())
    atexit.register(_write_calls)
