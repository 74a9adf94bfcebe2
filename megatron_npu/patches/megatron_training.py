"""Megatron-LM's own training stack (``megatron/training``, its ``pretrain_gpt.py``) off CUDA.

A user's Megatron-LM checkout on ``PYTHONPATH`` merges with the megatron-core wheel
(``megatron/`` is a namespace package). Verified against Megatron-LM core_v0.12.1 to core_v0.19.0
(``VERIFIED_RELEASES`` in megatron_npu.version), each with its megatron-core release line (a private
target that moved between tags has one patch per range). Targets in
``megatron.training`` modules are applied by the registry's import hook when the
script imports ``megatron.training``; nothing here applies on the cuda target.

What a plain redirection of ``torch.cuda`` (megatron_npu/patches/torch_cuda.py) does not cover:
import-time obstacles (an unguarded ``triton`` import, ``compile_helpers()`` running
``make``), CUDA-only checks (``assert torch.cuda.is_available()``, the GPU arch and
``CUDA_DEVICE_MAX_CONNECTIONS``), the ``nccl``-only backend choice, and argument
defaults that cannot apply off CUDA (``--transformer-impl transformer_engine``,
torch.compile'd jit fusions, nsys profiling), which become what works, one warning each.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import inspect
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_npu.accelerator.base import Accelerator, UnsupportedBackend
from megatron_npu.patches.grouped_gemm import serves_grouped_gemm
from megatron_npu.policy import DEVICE_REFUSED
from megatron_npu.registry import register
from megatron_npu.start_errors import report_start_error
from megatron_npu.version import TESTED_MEGATRON_CORE_RANGE, UnsupportedMegatronVersion, check_megatron_lm

SUBSYSTEM = "megatron_training"
VERSIONS = TESTED_MEGATRON_CORE_RANGE  # megatron-core range; Megatron-LM's own version is checked at import

BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def _given_flags(argv: list[str]) -> dict[str, str | None]:
    """Option strings on the command line, with the value that follows each (None: none)."""
    given: dict[str, str | None] = {}
    for index, token in enumerate(argv):
        if not token.startswith("--"):
            continue
        name, _, inline = token.partition("=")
        following = argv[index + 1] if index + 1 < len(argv) and not argv[index + 1].startswith("--") else None
        given[name] = inline or following
    return given


def device_refusal_message(argv: list[str]) -> str | None:
    """The one-line refusal for the first device-impossible flag in ``argv``, or None.

    Only the policy's device rows: upstream Megatron-LM has its own MoE, CP, FSDP, ..., so
    the rows about this project's trainer do not apply to it."""
    for name, value in _given_flags(argv).items():
        for row in DEVICE_REFUSED:
            if not row.matches(name):
                continue
            if row.allowed is not None and value in row.allowed:
                continue
            return row.message(name, value)
    return None


def _training_patch(
    name: str, reason: str, versions: str = VERSIONS, target: str | None = None
) -> Callable[[Callable[[Any, Accelerator], Any]], Any]:
    """register() for a megatron.training target (``target``, default: ``name`` as module.attribute) on the
    megatron-core ``versions``: the Megatron-LM version is checked first.

    The build runs when the import hook sees the target's module, i.e. before any of
    Megatron-LM's code is called; another Megatron-LM stops there with both versions named
    rather than failing later on a private name that moved.
    """

    def decorator(build: Callable[[Any, Accelerator], Any]) -> Any:
        def checked(original: Any, accelerator: Accelerator) -> Any:
            try:
                check_megatron_lm()
            except UnsupportedMegatronVersion as error:
                raise SystemExit(report_start_error(str(error))) from None
            return build(original, accelerator)

        module, attribute = name.rsplit(".", 1)
        where = target or f"{module}:{attribute}"
        return register(name, where, reason=reason, subsystem=SUBSYSTEM, megatron_versions=versions)(checked)

    return decorator


def _warn_once(message: str) -> None:
    # Every rank validates the same arguments: rank 0 speaks for them.
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"megatron-npu: warning: {message}", file=sys.stderr, flush=True)


# ----- import obstacles ---------------------------------------------------------------------


#: The aten ops megatron-core's batch-invariant mode replaces with its triton kernels (enable_batch_invariant_mode).
BATCH_INVARIANT_OPS = ("aten::mm", "aten::addmm", "aten::_log_softmax", "aten::mean.dim")
BATCH_INVARIANT_REFUSAL = (
    "batch-invariant mode: megatron-core's batch-invariant kernels ({op}) are triton (CUDA) kernels and triton is "
    "not installed"
)


def _batch_invariant_stand_in(accelerator: Accelerator) -> types.ModuleType:
    """``batch_invariant_kernels`` without triton: the mode's switches. Megatron-LM's start-up
    (``enable_batch_invariant_mode`` for ``--batch-invariant-mode``) is refused in one line; inside
    ``set_batch_invariant_mode(True)``, megatron-core's context manager, each op whose batch-invariant kernel is
    missing raises when it runs, so code that reaches none (a test that skips first) runs as upstream."""
    module = types.ModuleType(BATCH_INVARIANT, "batch-invariant kernels stand-in (triton is not importable)")
    state: dict[str, Any] = {"library": None}

    def enable_batch_invariant_mode() -> None:
        raise SystemExit(
            report_start_error(
                "--batch-invariant-mode is not supported: its kernels are triton (CUDA) kernels and triton is not "
                "installed; drop the flag"
            )
        )

    def _refusing_kernel(op: str) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(BATCH_INVARIANT_REFUSAL.format(op=op))

        return kernel

    def _enter() -> None:
        # The same seam the real mode uses (torch.library on the target's dispatch key), with refusing kernels.
        library = torch.library.Library("aten", "IMPL")
        dispatch_key = torch._C._dispatch_key_for_device(accelerator.device_type)
        for op in BATCH_INVARIANT_OPS:
            library.impl(op, _refusing_kernel(op), dispatch_key)
        state["library"] = library

    def _leave() -> None:
        if state["library"] is not None:
            state["library"]._destroy()
        state["library"] = None

    @contextlib.contextmanager
    def set_batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
        was_enabled = state["library"] is not None
        if enabled and not was_enabled:
            _enter()
        elif not enabled and was_enabled:
            _leave()
        try:
            yield
        finally:
            if enabled and not was_enabled:
                _leave()
            elif not enabled and was_enabled:
                _enter()

    module.enable_batch_invariant_mode = enable_batch_invariant_mode  # type: ignore[attr-defined]
    module.set_batch_invariant_mode = set_batch_invariant_mode  # type: ignore[attr-defined]
    module.disable_batch_invariant_mode = _leave  # type: ignore[attr-defined]
    module.is_batch_invariant_mode_enabled = lambda: state["library"] is not None  # type: ignore[attr-defined]
    module.__all__ = [  # type: ignore[attr-defined]
        "set_batch_invariant_mode",
        "is_batch_invariant_mode_enabled",
        "disable_batch_invariant_mode",
        "enable_batch_invariant_mode",
    ]
    module.__megatron_npu_stand_in__ = True  # type: ignore[attr-defined]
    return module


@register(
    "megatron.core.transformer.custom_layers.batch_invariant_kernels",
    "megatron.core.transformer.custom_layers:batch_invariant_kernels",
    reason="megatron/training/initialize.py imports this module, which imports triton unguarded; without triton "
    "(CPU torch, torch_npu) a stand-in with the same switches loads instead and refuses --batch-invariant-mode",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.16.0,<0.20",  # the module and initialize.py's import of it appear in 0.16
    create=True,
)
def _batch_invariant_kernels(original: Any, accelerator: Accelerator) -> types.ModuleType:
    if BATCH_INVARIANT in sys.modules:
        return sys.modules[BATCH_INVARIANT]
    if importlib.util.find_spec("triton") is not None:
        return importlib.import_module(BATCH_INVARIANT)  # the real kernels' module imports
    module = _batch_invariant_stand_in(accelerator)
    sys.modules[BATCH_INVARIANT] = module  # `from ...batch_invariant_kernels import x` reads sys.modules
    return module


@register(
    "megatron.core.datasets.utils.compile_helpers",
    "megatron.core.datasets.utils:compile_helpers",
    reason="initialize.py and run_simple_mcore_train_loop.py run `make` in the wheel's megatron/core/datasets, "
    "which has no Makefile: the wheel ships the compiled helpers, so make runs only when they are missing",
    subsystem=SUBSYSTEM,
    megatron_versions=VERSIONS,
)
def _compile_helpers(original: Callable[[], None], accelerator: Accelerator) -> Callable[[], None]:
    @functools.wraps(original)
    def compile_helpers() -> None:
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
            return None
        return original()

    return compile_helpers


# ----- initialisation -------------------------------------------------------------------------


@_training_patch(
    "megatron.training.initialize.initialize_megatron",
    reason="initialize.py:62 asserts torch.cuda.is_available(); the accelerator is the device here (device_count, "
    "set_device and seeding already answer for it, so model-parallel init and RNG seeding run as on CUDA)",
)
def _initialize_megatron(original: Callable[..., Any], accelerator: Accelerator) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        if not accelerator.is_available():
            raise SystemExit(
                report_start_error(
                    f"no {accelerator.device_type} device is visible to this process; "
                    f"check {accelerator.visible_devices_envvar}"
                )
            )
        bound = signature.bind(*args, **kwargs)
        bound.arguments["allow_no_cuda"] = True
        return original(*bound.args, **bound.kwargs)

    return initialize_megatron


@_training_patch(
    "megatron.training.initialize._compile_dependencies",
    reason="loads megatron/legacy/fused_kernels, which runs $CUDA_HOME/bin/nvcc -V; only the dataset helpers "
    "(compile_helpers, shipped compiled in the wheel) apply off CUDA",
)
def _compile_dependencies(original: Callable[[], None], accelerator: Accelerator) -> Callable[[], None]:
    def compile_dependencies() -> None:
        from megatron.core.datasets.utils import compile_helpers

        if torch.distributed.get_rank() == 0:
            compile_helpers()
        torch.distributed.barrier()  # as upstream: no rank reads the helpers before rank 0 built them

    return compile_dependencies


JIT_WARMUP_REASON = (
    "warms up megatron-core's torch.compile'd fusions (about 30 s per process on cpu, no npu backend); "
    "skipped where the accelerator does not fuse them (the fusion flags are turned off in validate_args)"
)


@_training_patch(
    "megatron.training.initialize.set_jit_fusion_options",
    reason=JIT_WARMUP_REASON,
    versions=">=0.12.0,<0.19",  # set_jit_fusion_options() takes no arguments up to core_v0.18.x
)
def _set_jit_fusion_options(original: Callable[[], None], accelerator: Accelerator) -> Callable[[], None]:
    @functools.wraps(original)
    def set_jit_fusion_options() -> None:
        if accelerator.supports_jit_fusion:
            original()

    return set_jit_fusion_options


@_training_patch(
    "megatron.training.initialize.set_jit_fusion_options.tp_size",
    reason=JIT_WARMUP_REASON,
    versions=">=0.19.0,<0.20",  # core_v0.19.0's training.py calls set_jit_fusion_options(tp_size=...)
    target="megatron.training.initialize:set_jit_fusion_options",
)
def _set_jit_fusion_options_tp(original: Callable[..., None], accelerator: Accelerator) -> Callable[..., None]:
    @functools.wraps(original)
    def set_jit_fusion_options(tp_size: int | None = None) -> None:
        if accelerator.supports_jit_fusion:
            original(tp_size=tp_size)

    return set_jit_fusion_options


ARCH_REASON = (
    "reads the CUDA compute capability (get_device_properties().major); off CUDA there is no CUDA arch: 0, "
    "so no Blackwell-only path is taken"
)


@_training_patch("megatron.training.utils.get_device_arch_version", reason=ARCH_REASON, versions=">=0.12.0,<0.18")
def _get_device_arch_version(original: Callable[[], int], accelerator: Accelerator) -> Callable[[], int]:
    return lambda: 0


@_training_patch(
    "megatron.training.utils.common_utils.get_device_arch_version",
    reason=ARCH_REASON,
    versions=">=0.18.0,<0.20",  # core_v0.18.0 made megatron/training/utils a package (common_utils.py)
)
def _get_device_arch_version_common(original: Callable[[], int], accelerator: Accelerator) -> Callable[[], int]:
    return lambda: 0


@_training_patch(
    "megatron.training.dist_signal_handler.get_device",
    reason="the --exit-signal-handler maps only nccl/gloo to a device and raises for hccl; the accelerator's device",
)
def _signal_handler_device(original: Callable[..., Any], accelerator: Accelerator) -> Callable[..., Any]:
    return lambda local_rank=None: accelerator.device(local_rank)


# ----- arguments ------------------------------------------------------------------------------

#: Megatron-LM's torch.compile'd fusion switches, turned off with a warning where the accelerator has no jit
#: fuser (megatron_npu/patches/transformer.py turns the same fields off in any TransformerConfig; this names the flags).
_JIT_FUSIONS = ("bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion")


def adapt_args(args: argparse.Namespace, argv: list[str], accelerator: Accelerator) -> None:
    """Make Megatron-LM's parsed arguments run on ``accelerator``: refuse, or default to what works."""
    refusal = device_refusal_message(argv)
    if refusal is not None:
        raise SystemExit(report_start_error(refusal))
    given = _given_flags(argv)
    if args.transformer_impl == "transformer_engine" and "--transformer-impl" not in given:
        args.transformer_impl = "local"
        _warn_once("--transformer-impl defaults to transformer_engine (CUDA-only): using local")
    try:  # the accelerator says which requested backends it runs, and as what (this trainer asks the same)
        backend = accelerator.collective_backend_for(args.distributed_backend)
    except UnsupportedBackend as error:
        raise SystemExit(report_start_error(f"--distributed-backend {args.distributed_backend}: {error}")) from None
    if backend != args.distributed_backend:
        _warn_once(f"--distributed-backend {args.distributed_backend}: using {backend}")
        args.distributed_backend = backend
    if not accelerator.supports_jit_fusion:
        enabled = [name for name in _JIT_FUSIONS if getattr(args, name, False)]
        if enabled:
            for name in enabled:
                setattr(args, name, False)
            _warn_once(f"{', '.join(enabled)}: megatron-core's torch.compile'd fusions do not run here: unfused")
    if _rope_fusion_unavailable(args, accelerator):  # megatron-core's TransformerConfig raises on it
        args.apply_rope_fusion = False
        _warn_once("apply_rope_fusion: no fused RoPE kernel here (Transformer Engine's or the device's): unfused")
    if (
        getattr(args, "gradient_accumulation_fusion", False)
        and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None
    ):  # apex's CUDA extension; megatron-core raises at model build without it
        args.gradient_accumulation_fusion = False
        _warn_once("gradient_accumulation_fusion needs apex's CUDA extension: off")
    if getattr(args, "profile", False) and not getattr(args, "use_pytorch_profiler", False):
        args.use_pytorch_profiler = True
        _warn_once("--profile uses nsys (cudaProfilerStart, emit_nvtx), CUDA-only: using --use-pytorch-profiler")
    # The variable orders CUDA kernel launches; off CUDA it has no effect, so validate_args'
    # demand for it (TP > 1 before Blackwell; FSDP: anything but 1) guards nothing here.
    # Under FSDP an exported 1 (Megatron-LM's example scripts export it) is replaced too: it orders nothing.
    fsdp = getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False)
    if fsdp and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1") == "1":
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def _rope_fusion_unavailable(args: argparse.Namespace, accelerator: Accelerator) -> bool:
    """Megatron-LM's default --apply-rope-fusion with RoPE, where neither Transformer Engine nor the
    device's half-split kernel (megatron_npu/patches/fused_ops.py fills megatron-core's slot with it) can serve it."""
    if not getattr(args, "apply_rope_fusion", False) or args.position_embedding_type not in ("rope", "mrope"):
        return False
    if importlib.util.find_spec("transformer_engine") is not None:
        return False
    return not accelerator.has_fused_rotary or bool(getattr(args, "rotary_interleaved", False))


@_training_patch(
    "megatron.training.arguments.validate_args",
    reason="defaults that cannot apply off CUDA become what works (transformer_engine -> local, nccl -> the "
    "device's backend, jit fusions off, RoPE fusion off without a kernel, nsys -> torch profiler), one warning "
    "each; device-impossible flags (fp8, TE, CUDA graphs, TP comm overlap) stop every rank with one line; the "
    "Megatron-LM version is checked; --moe-grouped-gemm's CUDA-arch assertion passes where the project's grouped "
    "GEMM serves megatron-core (patches/grouped_gemm.py)",
)
def _validate_args(original: Callable[..., Any], accelerator: Accelerator) -> Callable[..., Any]:
    @functools.wraps(original)
    def validate_args(args: argparse.Namespace, defaults: dict | None = None) -> Any:
        adapt_args(args, sys.argv[1:], accelerator)
        with _grouped_gemm_capability(args):
            return original(args, {} if defaults is None else defaults)

    return validate_args


#: The CUDA arch the grouped_gemm package's kernels need (validate_args: "Unsupported compute capability for
#: GroupedGEMM kernels" below it).
GROUPED_GEMM_CUDA_ARCH = (8, 0)


@contextlib.contextmanager
def _grouped_gemm_capability(args: argparse.Namespace) -> Iterator[None]:
    """--moe-grouped-gemm: validate_args asserts ``torch.cuda.get_device_capability()[0] >= 8`` for the grouped_gemm
    package's CUDA kernels (core_v0.12.1 ... core_v0.19.0, its one capability reader). Where megatron-core's grouped
    GEMM is the project's (megatron_npu/patches/grouped_gemm.py: the package absent), none of those kernels runs, so
    for the span of validate_args the question is answered with the arch they need; elsewhere it stands."""
    if not getattr(args, "moe_grouped_gemm", False) or not serves_grouped_gemm():
        yield
        return
    answer = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: GROUPED_GEMM_CUDA_ARCH
    try:
        yield
    finally:
        torch.cuda.get_device_capability = answer
