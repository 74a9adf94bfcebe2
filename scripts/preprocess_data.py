"""Megatron-LM-compatible tools/preprocess_data.py (see megatron_npu.data.preprocess)."""

import importlib.machinery
import importlib.util
import sys
import warnings


def _import_without_patch_layer() -> None:
    """``import megatron_npu`` applies the patch layer, which imports torch (2+ s of a run's
    start-up); preprocessing needs neither. Register the package by its location only, so its
    torch-free data modules import alone (megatron-core's tokenizers still import torch when
    the chosen tokenizer needs them)."""
    if "megatron_npu" in sys.modules:
        return
    spec = importlib.util.find_spec("megatron_npu")
    if spec is None or not spec.submodule_search_locations:
        return
    package = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("megatron_npu", None, is_package=True))
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["megatron_npu"] = package
    # as `import megatron_npu` does: megatron-core's notice that it runs without TE / apex is expected
    warnings.filterwarnings("ignore", message=r"(Transformer Engine|Apex).* not installed", category=UserWarning)


if __name__ == "__main__":
    _import_without_patch_layer()
    from megatron_npu.data.preprocess import main

    sys.exit(main())
