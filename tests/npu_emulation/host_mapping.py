"""The npu target's accelerator on the host: NpuAccelerator with the facts of the machine it really runs on.

There is no NPU and no HCCL here: tensors live in host memory and gloo moves them. So the answers that describe
the device's memory and the collective library are the cpu target's (each named below with why); everything else,
the fused kernels and their torch_npu calling conventions, the sparsity arguments of npu_fusion_attention, the
grouped matmul's backward, unbatched pipeline p2p, HCCL's timeouts, the float64 reduction, ``torch.npu`` for the
device, RNG, streams and memory, is NpuAccelerator's own code, run over the reference torch_npu.
"""

from __future__ import annotations

from megatron_npu.accelerator.cpu import CpuAccelerator

#: member -> why it is the host's
HOST_FACTS = {
    "device_type": "tensors are host tensors: torch has no 'npu' device without the real torch_npu",
    "communication_backend": "gloo moves the tensors (HCCL needs NPUs)",
    "backend_aliases": "the backends gloo stands in for",
    "runs_on_host": "a process group binds no device; the host is one device",
    "process_group_environment": "gloo's lazy connection (what the cpu target sets)",
    "stream_ordered_p2p": "gloo reads a send buffer after the call returns",
    "gathers_uneven": "gloo refuses uneven all_gather",
    "reduces_premul_sum": "gloo refuses PREMUL_SUM",
    "gathers_by_element_count": "gloo compares all_gather chunk shapes",
    "groups_hold_threads": "gloo groups keep threads",
    "overlaps_works_safely": "gloo's two work threads",
    "device_rng_is_host_rng": "the emulated torch.npu draws from the host generator",
    "pin_memory": "no device to pin host memory for",
    "supports_pinned_memory": "no device to pin host memory for",
}


def host_mapped(npu_class: type) -> type:
    """A subclass of ``npu_class`` whose HOST_FACTS are CpuAccelerator's."""
    members = {name: getattr(CpuAccelerator, name) for name in HOST_FACTS}
    members["__doc__"] = __doc__
    members["__module__"] = __name__
    return type("HostMappedNpu", (npu_class,), members)
