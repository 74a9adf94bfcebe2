"""The accelerator interface: one object answers every device question.

Modelled on DeepSpeed's accelerator abstraction. Everything in megatron_npu that
needs to know the device type, the collective backend, the RNG, streams or memory
asks ``get_accelerator()``; no other module names a device or a backend.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import torch


class UnsupportedBackend(ValueError):
    """A collective backend this target cannot run; the message says what to use instead."""


class Accelerator(abc.ABC):
    """Device questions megatron-core asks, answered for one target."""

    #: ``torch.device`` type of the compute device ("npu", "cuda", "cpu").
    device_type: str
    #: torch.distributed backend for compute collectives ("hccl", "nccl", "gloo").
    communication_backend: str
    #: Environment variable that restricts the visible devices.
    visible_devices_envvar: str
    #: Backend names a script may ask for -> the backend that runs them here. Megatron-LM
    #: scripts say "nccl" (its default) for "the device's collectives"; a name missing
    #: here cannot run on this target.
    backend_aliases: Mapping[str, str] = MappingProxyType({})
    #: True when compute runs on the host (the cpu target): there is no accelerator
    #: device to count, to index or to bind a process group or DDP to.
    runs_on_host: bool = False
    #: True when the target is upstream CUDA: megatron-core needs no patch.
    is_upstream: bool = False
    #: True when separate isend/irecv beats batch_isend_irecv for pipeline p2p
    #: (HCCL: MindSpeed turns batched p2p off for PP>=2 on Ascend).
    prefers_unbatched_p2p: bool = False
    #: True when the device RNG is the host RNG (cpu target): megatron's warning
    #: "CPU RNG state changed within GPU RNG context" is then expected.
    device_rng_is_host_rng: bool = False
    #: True when TorchScript fuses megatron-core's jit fusions (bias-gelu, bias-swiglu,
    #: bias-dropout-add) into device kernels. Off elsewhere: the fuser has no npu
    #: backend, and on cpu its first call compiles for about 30 s.
    supports_jit_fusion: bool = False
    #: True when an async p2p send is ordered on the device stream, so its buffer may
    #: be freed right after the call (megatron's deallocate_pipeline_outputs). Gloo
    #: (cpu) reads the buffer later: freeing it early sends garbage.
    stream_ordered_p2p: bool = True
    #: True when the collective library all-reduces float64 tensors. HCCL has lacked it
    #: (../shared/design/ascend-facts.md); Megatron-LM's trainer reduces float64 start-up
    #: timestamps, whose seconds-since-epoch need float64's precision.
    reduces_float64: bool = True
    #: True when all_gather takes tensors of different sizes per rank (MoE's alltoall dispatcher
    #: gathers its tokens over expert TP this way). Gloo refuses them (torch 2.13, measured).
    gathers_uneven: bool = True
    #: True when the collective library takes torch's PREMUL_SUM reduce op (scale, then sum: what
    #: Megatron-FSDP reduces gradients with). Gloo refuses it (torch 2.13, measured); HCCL takes it
    #: (torch_npu re-exports it as ``_make_hccl_premul_sum``).
    reduces_premul_sum: bool = True

    #: True when all_gather_into_tensor checks only element counts (NCCL, HCCL). Gloo compares
    #: each output chunk's shape with the input's: a (2, 4) input into a flat output is refused
    #: (torch 2.13, measured by megatron-core's test_gather_split_1d_tensor).
    gathers_by_element_count: bool = True
    #: True when a process group keeps threads of its own until destroyed (gloo: its worker threads
    #: and one polling its socket every 10 ms, measured): groups dropped without destroy_process_group pile up.
    groups_hold_threads: bool = False
    #: True when one process group may run several of its asynchronous works at once (NCCL, HCCL:
    #: ordered on streams). Torch 2.13's gloo runs a group's works on two threads, and with two of
    #: them in flight it corrupts the heap: Megatron-FSDP's prefetched all-gathers beside the next
    #: collective crashed 7 of 15 runs of 60 iterations (glibc "unaligned tcache chunk", SIGSEGV),
    #: none of 15 with one thread a group (measured).
    overlaps_works_safely: bool = True

    #: True when the device stands in for CUDA in user scripts: ``torch.cuda.is_available()``
    #: and the device name answer for it, so a GPU script takes its device path.
    stands_in_for_cuda: bool = False

    # ----- capabilities the patch set asks -----------------------------------
    @property
    def patches_megatron_core(self) -> bool:
        """True when megatron-core's CUDA calls must be redirected (every target but upstream CUDA)."""
        return not self.is_upstream

    @property
    def has_fused_kernels(self) -> bool:
        return any(self.fused_ops().values())

    @property
    def lacks_jit_fusion(self) -> bool:
        return not self.supports_jit_fusion

    @property
    def has_fused_rotary(self) -> bool:
        return self.fused_kernel("rotary") is not None

    @property
    def lacks_pinned_memory(self) -> bool:
        return not self.supports_pinned_memory()

    @property
    def lacks_float64_reduction(self) -> bool:
        return self.patches_megatron_core and not self.reduces_float64

    @property
    def lacks_uneven_all_gather(self) -> bool:
        return self.patches_megatron_core and not self.gathers_uneven

    @property
    def lacks_premul_sum(self) -> bool:
        return self.patches_megatron_core and not self.reduces_premul_sum

    @property
    def lacks_flat_all_gather(self) -> bool:
        return self.patches_megatron_core and not self.gathers_by_element_count

    @property
    def lacks_safe_work_overlap(self) -> bool:
        return self.patches_megatron_core and not self.overlaps_works_safely

    def process_group_environment(self) -> dict[str, str]:
        """Variables the collective library reads when a process group is created (none here)."""
        return {}

    @property
    def renames_cuda_device(self) -> bool:
        """True when a tensor megatron-core moves with ``.cuda()`` / ``device='cuda'`` reports this target's own
        device type, not ``'cuda'`` (npu: torch_npu's device; cpu: the host): code asserting
        ``tensor.device.type == 'cuda'`` cannot hold here."""
        return self.device_type != "cuda"

    @property
    def collectives_bind_device(self) -> bool:
        """True when a process group binds a device (``device_id``); gloo on the host binds none."""
        return not self.runs_on_host

    def collective_backend_for(self, requested: str | None) -> str:
        """The torch.distributed backend that runs ``requested`` here (None: this target's own).

        Raises UnsupportedBackend naming the backends this target runs.
        """
        if requested is None:
            return self.communication_backend
        backend = self.backend_aliases.get(requested.lower())
        if backend is None:
            runs = ", ".join(sorted(self.backend_aliases))
            raise UnsupportedBackend(f"the {self.name} target cannot run {requested} collectives; use one of {runs}")
        return backend

    def capability(self, name: str) -> bool:
        """The boolean capability ``name`` (an attribute or property of this class).

        Patches name the capability they need (``Patch.requires``), so that which
        patches apply is decided here, by behaviour, never by a device name.
        """
        value = getattr(self, name, None)
        if not isinstance(value, bool):
            raise AttributeError(f"{type(self).__name__} has no boolean capability {name!r}")
        return value

    # ----- identity --------------------------------------------------------
    @property
    def name(self) -> str:
        return self.device_type

    def is_available(self) -> bool:
        return self.device_count() > 0

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def current_device(self) -> int: ...

    @abc.abstractmethod
    def set_device(self, index: int | str | torch.device) -> None: ...

    def device(self, index: int | None = None) -> torch.device:
        """The torch.device for ``index`` (default: the current device)."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self.current_device() if index is None else index)

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in this target's device memory. megatron-core asks ``tensor.is_cuda``, False
        for an npu tensor (and on the cpu target, whose device is the host, for every tensor)."""
        return tensor.device.type == self.device_type

    def device_name(self, index: int | None = None) -> str:
        """Marketing name of the device, used for the MFU peak table."""
        return self.device_type

    def collective_timeout_environment(self, timeout: timedelta, environ: Mapping[str, str]) -> dict[str, str]:
        """Environment variables to set so the collective library gives up on a stuck collective
        after ``timeout`` (init_process_group's, i.e. ``--distributed-timeout-minutes``).

        Empty where the process group's own watchdog applies the timeout (NCCL, gloo); variables
        already in ``environ`` are the user's choice and are never returned.
        """
        return {}

    # ----- synchronisation, streams, events ---------------------------------
    @abc.abstractmethod
    def synchronize(self, device: Any = None) -> None: ...

    @property
    @abc.abstractmethod
    def Stream(self) -> type: ...  # noqa: N802 - mirrors torch.cuda.Stream

    @property
    @abc.abstractmethod
    def Event(self) -> type: ...  # noqa: N802 - mirrors torch.cuda.Event

    @abc.abstractmethod
    def current_stream(self, device: Any = None) -> Any: ...

    @abc.abstractmethod
    def default_stream(self, device: Any = None) -> Any: ...

    @abc.abstractmethod
    def stream(self, stream: Any) -> contextlib.AbstractContextManager: ...

    def set_stream(self, stream: Any) -> None:
        """Make ``stream`` current (a no-op where streams are not real)."""

    # ----- RNG ---------------------------------------------------------------
    @abc.abstractmethod
    def get_rng_state(self, device: Any = None) -> torch.Tensor: ...

    @abc.abstractmethod
    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None: ...

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None: ...

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)

    @abc.abstractmethod
    def default_generator(self, index: int | None = None) -> torch.Generator:
        """The generator megatron's RNG tracker forks (dropout draws from it)."""

    # ----- memory -----------------------------------------------------------
    @abc.abstractmethod
    def memory_allocated(self, device: Any = None) -> int: ...

    @abc.abstractmethod
    def max_memory_allocated(self, device: Any = None) -> int: ...

    @abc.abstractmethod
    def memory_reserved(self, device: Any = None) -> int: ...

    def max_memory_reserved(self, device: Any = None) -> int:
        return self.memory_reserved(device)

    @abc.abstractmethod
    def memory_stats(self, device: Any = None) -> dict[str, Any]: ...

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        """Reset the peak counters (a no-op where none exist)."""

    def empty_cache(self) -> None:
        """Release cached blocks (a no-op where no caching allocator exists)."""

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-lock a host tensor for fast copies (identity on the cpu target)."""
        return tensor.pin_memory()

    def supports_pinned_memory(self) -> bool:
        return True

    # ----- dtypes, autocast, kernels -----------------------------------------
    def autocast_device_type(self) -> str:
        return self.device_type

    def fused_ops(self) -> dict[str, bool]:
        """Which fused kernels exist on this target, by Megatron's name for them."""
        kernels = ("flash_attention", "rms_norm", "swiglu", "rotary", "grouped_matmul")
        context_parallel = ("attention_block", "attention_block_grad", "attention_merge")
        return dict.fromkeys(kernels + context_parallel, False)

    def profiler_activities(self) -> list:
        """torch.profiler activities that see this device's work (host only by default)."""
        return [torch.profiler.ProfilerActivity.CPU]

    #: What ``profiler(trace_dir, name)`` leaves in trace_dir: "chrome" (the caller exports NAME.json with
    #: export_chrome_trace), or a tool's own layout the profiler writes itself when it stops.
    profiler_output = "chrome"

    def profiler(self, trace_dir: str | None = None, name: str = "trace") -> Any:
        """A profiler over this device's work: a context manager with export_chrome_trace(path)."""
        return torch.profiler.profile(activities=self.profiler_activities())

    def fused_kernel(self, key: str) -> Callable | None:
        """The device kernel for fusion ``key`` of fused_ops(), or None (use the torch math).

        Neutral signatures, whatever the device library's conventions (torch twins in
        megatron_npu/ops/fused.py):
        ``"rms_norm"``: (x, weight, eps) -> y;  ``"swiglu"``: (x) -> silu(x1) * x2 over the last
        dim's halves;  ``"rotary"``: (t, cos, sin) -> t * cos + rotate_half(t) * sin (half-split);
        ``"flash_attention"``: (query [sq, b, np, hn], key [sk, b, ng, hn], value [sk, b, ng, hv], *,
        softmax_scale, dropout_p, attention_mask (True = masked, [b, 1, sq, sk]) or None, window (left,
        right) or None) -> attention [sq, b, np * hv], causal when neither is given;  ``"grouped_matmul"``:
        (x [m, k], weights [n, k] each, tokens_per_expert) -> [m, n], rows of group i times
        weights[i]^T, differentiable (twin in megatron_npu/ops/grouped_gemm.py). Context parallelism's
        blocks (twins in megatron_npu/ops/attention_blocks.py; statistics fp32 [b, np, sq, k]):
        ``"attention_block"``: (query, key, value, *, softmax_scale, causal, band) -> (out [sq, b, np, hn],
        softmax_max, softmax_sum), band (pre, next) or None: key j seen by query i iff i - pre <= j <= i + next
        (block-local, every row keeps a key), in place of causal;  ``"attention_block_grad"``: (query, key,
        value, dout, out, softmax_max, softmax_sum, *, softmax_scale, causal, band) -> (dq, dk, dv);  ``"attention_merge"``:
        (out, softmax_max, softmax_sum, block_out, block_max, block_sum) -> the merged triple.
        """
        return None

    def peak_tflops(self, dtype: torch.dtype = torch.bfloat16) -> float | None:
        """Dense peak TFLOP/s of one device for MFU, or None when unknown."""
        return None

    # ----- host tensors megatron-core builds ---------------------------------
    def tensor_type_prefix(self) -> str:
        """Prefix of ``Tensor.type()`` for tensors on this target ("torch.npu")."""
        return f"torch.{self.device_type}" if self.device_type != "cpu" else "torch"

    def versions(self) -> dict[str, str]:
        """Versions of the device software stack (torch_npu, CANN, CUDA, ...)."""
        return {}
