"""The npu target emulated on the host, for processes a test starts with this folder on PYTHONPATH.

Opt-in: ``MEGATRON_NPU_EMULATE=1`` (and ``MEGATRON_NPU_DEVICE=npu``, the target the trainer is asked for); otherwise
this file does nothing. Python imports ``sitecustomize`` at start-up, before any of the project's code, so the
production code never learns about the emulation. Two import hooks, nothing imported until it is needed:

- ``import torch_npu`` returns a module built from tests/accelerator/npu_reference.py (the operators as CANN documents
  them, ``torch.npu`` mapped onto the host);
- once ``megatron_npu.accelerator.npu`` has run, its ``NpuAccelerator`` is replaced by ``host_mapping.HostMappedNpu``,
  the same class with the facts of where tensors live and which collective library moves them taken from the cpu
  target (there is no NPU and no HCCL here); every other decision stays npu.py's.

With ``MEGATRON_NPU_EMULATION_LOG=DIR`` each process writes DIR/rank<RANK>.json at exit: the operators it called,
by kind (tests/accelerator/test_npu_emulated_run.py reads them to show which npu branches ran).
"""

import os

if os.environ.get("MEGATRON_NPU_EMULATE") == "1":
    import importlib.util
    import sys

    _spec = importlib.util.spec_from_file_location(
        "npu_emulation_hooks", os.path.join(os.path.dirname(os.path.abspath(__file__)), "hooks.py")
    )
    _hooks = importlib.util.module_from_spec(_spec)
    sys.modules["npu_emulation_hooks"] = _hooks
    _spec.loader.exec_module(_hooks)
    _hooks.install()
