"""Hardware facts of the targets, readable without torch, torch_npu or an accelerator instance.

The communication planner and perf-report read link bandwidths here; the accelerator reads its
peak TFLOP/s here (``NpuAccelerator.facts``). Only this package names the hardware.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class TargetFacts:
    """Per-device figures of one target's cluster."""

    intra_node_link: str  # what ranks of one node talk over
    inter_node_link: str  # what nodes talk over
    intra_node_gbps: float  # GB/s per device inside a node
    inter_node_gbps: float  # GB/s per device between nodes
    # dense bf16/fp16 peak TFLOP/s by a substring of the device name, for MFU
    peak_tflops_bf16: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    device: str = ""  # the planning device's name (a key of peak_tflops_bf16)
    device_memory_gb: float = 0.0  # memory per device, GB (1e9 bytes), for the planner's fit check


# Atlas 800T A2 (Ascend 910B). ASSUMPTIONS (ascend-facts.md names the links, not their speed;
# measure and override with the planner's --intra-gbps / --inter-gbps):
NPU_FACTS = TargetFacts(
    intra_node_link="HCCS",
    inter_node_link="RoCE",
    intra_node_gbps=196.0,  # HCCS: 392 GB/s bidirectional quoted per 910B
    inter_node_gbps=25.0,  # one 200 Gb/s RoCE port per NPU
    peak_tflops_bf16=MappingProxyType({"910B": 354.0, "910_93": 354.0}),
    device="910B",
    device_memory_gb=64.0,  # Ascend 910B HBM per NPU (Atlas 800T A2)
)

# The cluster `megatron-npu plan` and perf-report estimate for: this project's target.
PLANNING_FACTS = NPU_FACTS

#: The torch_npu release the npu target is checked against: its wheel's Python API is what
#: tests/accelerator/test_npu_contract.py reads, and the doctor reports it beside the installed one.
TESTED_TORCH_NPU = "2.14.0"
