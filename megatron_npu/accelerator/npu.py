"""The npu target: Ascend NPUs through torch_npu, collectives over HCCL.

torch_npu is imported only when this target is selected (it needs CANN). Every
``torch.npu.*`` / ``torch_npu.*`` name used here is checked against the real
torch_npu wheel by tests/accelerator/test_npu_contract.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import torch

from .base import Accelerator
from .facts import NPU_FACTS, TargetFacts


def import_torch_npu() -> Any:
    """Import torch_npu (registers torch.npu and the hccl backend)."""
    import torch_npu  # noqa: F401  (optional extra: megatron-npu[npu])

    return torch_npu


# Megatron's name for a fusion -> the torch_npu kernel (signatures in torch_npu 2.14's
# op_plugin meta registrations; tests/accelerator/test_npu_contract.py checks them in the wheel).
_FUSED_KERNELS = {
    "flash_attention": "npu_fusion_attention",
    "rms_norm": "npu_rms_norm",  # (x, gamma, epsilon) -> (y, rstd)
    "swiglu": "npu_swiglu",  # (x, dim) -> silu(first half) * second half
    "rotary": "npu_rotary_mul",  # (embedding, cosine, sine, mode='half') -> x * cos + rotate_half(x) * sin
    "grouped_matmul": "npu_grouped_matmul",  # ([x], [w_i], *, group_list, split_item, group_type, ...) -> [y]
    # context parallelism's blocks: attention with its softmax_max / softmax_sum ([B, N, S, 8] fp32),
    # its backward from the whole row's statistics, and the online-softmax merge (SBH)
    "attention_block": "npu_fusion_attention",
    "attention_block_grad": "npu_fusion_attention_grad",
    "attention_merge": "npu_ring_attention_update",
}


# CANN's environment-variable reference for Atlas A2/A3: HCCL_EXEC_TIMEOUT in whole seconds,
# [0, 2147483647], 0 = never (HCCL itself caps it at 1091 s in its AIV expansion mode);
# HCCL_CONNECT_TIMEOUT (link set-up) in [120, 7200] s, default 120.
HCCL_EXEC_TIMEOUT_MAX_S = 2147483647
# npu_fusion_attention's default pre/next token window: every key
_ALL_TOKENS = 2147483647
HCCL_CONNECT_TIMEOUT_RANGE_S = (120, 7200)


class NpuAccelerator(Accelerator):
    device_type = "npu"
    communication_backend = "hccl"
    visible_devices_envvar = "ASCEND_RT_VISIBLE_DEVICES"
    # nccl (every Megatron-LM script's default) means the device library: HCCL here.
    # gloo is refused: it cannot move npu tensors.
    backend_aliases = MappingProxyType({"hccl": "hccl", "nccl": "hccl"})
    prefers_unbatched_p2p = True
    stands_in_for_cuda = True
    reduces_float64 = False  # reduced exactly by megatron_npu/patches/distributed.py instead
    #: link bandwidths and peak TFLOP/s (facts.py: readable without torch_npu)
    facts: TargetFacts = NPU_FACTS

    def __init__(self) -> None:
        self._torch_npu = import_torch_npu()
        self._npu = torch.npu

    def collective_timeout_environment(self, timeout: timedelta, environ: Mapping[str, str]) -> dict[str, str]:
        """HCCL's own timeouts follow the process group's: without them a collective stuck on the
        device waits HCCL's default 1836 s whatever ``--distributed-timeout-minutes`` says, and a
        peer that never connects fails after 120 s even when the flag allows more."""
        seconds = max(1, round(timeout.total_seconds()))
        low, high = HCCL_CONNECT_TIMEOUT_RANGE_S
        wanted = {
            "HCCL_EXEC_TIMEOUT": str(min(seconds, HCCL_EXEC_TIMEOUT_MAX_S)),
            "HCCL_CONNECT_TIMEOUT": str(min(max(seconds, low), high)),
        }
        return {name: value for name, value in wanted.items() if name not in environ}

    def device_count(self) -> int:
        return self._npu.device_count()

    def current_device(self) -> int:
        return self._npu.current_device()

    def set_device(self, index: int | str | torch.device) -> None:
        self._npu.set_device(index)

    def device_name(self, index: int | None = None) -> str:
        return self._npu.get_device_name(index)

    def synchronize(self, device: Any = None) -> None:
        self._npu.synchronize(device)

    @property
    def Stream(self) -> type:  # noqa: N802
        return self._npu.Stream

    @property
    def Event(self) -> type:  # noqa: N802
        return self._npu.Event

    def current_stream(self, device: Any = None) -> Any:
        return self._npu.current_stream(device)

    def default_stream(self, device: Any = None) -> Any:
        return self._npu.default_stream(device)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return self._npu.stream(stream)

    def set_stream(self, stream: Any) -> None:
        self._npu.set_stream(stream)

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return self._npu.get_rng_state() if device is None else self._npu.get_rng_state(device)

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        if device is None:
            self._npu.set_rng_state(state)
        else:
            self._npu.set_rng_state(state, device)

    def manual_seed(self, seed: int) -> None:
        self._npu.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self._npu.manual_seed_all(seed)

    def default_generator(self, index: int | None = None) -> torch.Generator:
        return self._npu.default_generators[self.current_device() if index is None else index]

    def memory_allocated(self, device: Any = None) -> int:
        return self._npu.memory_allocated(device)

    def max_memory_allocated(self, device: Any = None) -> int:
        return self._npu.max_memory_allocated(device)

    def memory_reserved(self, device: Any = None) -> int:
        return self._npu.memory_reserved(device)

    def max_memory_reserved(self, device: Any = None) -> int:
        return self._npu.max_memory_reserved(device)

    def memory_stats(self, device: Any = None) -> dict[str, Any]:
        return self._npu.memory_stats(device)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._npu.reset_peak_memory_stats(device)

    def empty_cache(self) -> None:
        self._npu.empty_cache()

    def fused_ops(self) -> dict[str, bool]:
        return {key: hasattr(self._torch_npu, op) for key, op in _FUSED_KERNELS.items()}

    def fused_kernel(self, key: str) -> Callable | None:
        # torch_npu's calling conventions stay here; callers see the neutral signatures of
        # Accelerator.fused_kernel.
        op = _FUSED_KERNELS.get(key)
        if op is None or not hasattr(self._torch_npu, op):
            return None
        return getattr(self, f"_fused_{key}")

    def _fused_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]  # (y, rstd)

    def _fused_swiglu(self, x: torch.Tensor) -> torch.Tensor:
        return self._torch_npu.npu_swiglu(x, dim=-1)

    def _fused_rotary(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._torch_npu.npu_rotary_mul(t, cos, sin)  # mode='half': half-split, as megatron's bshd

    def _fused_flash_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        softmax_scale: float,
        dropout_p: float = 0.0,
        attention_mask: torch.Tensor | None = None,
        window: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        sq, batch, heads, head_dim = query.shape
        sk, value_dim = key.shape[0], value.shape[-1]
        if value_dim != head_dim:
            # MLA: value padded with zeros to the query/key head size, as MindSpeed-LLM pads it (the op's
            # documented constraints give one D; the zero channels add nothing and are cut off below)
            value = torch.nn.functional.pad(value, (0, head_dim - value_dim))
        # SBH layout, GQA by head counts; True in atten_mask = masked (CANN's polarity, megatron's too)
        mask, sparse_mode, pre_tokens, next_tokens = _attention_sparsity(sq, sk, query.device, attention_mask, window)
        out = self._torch_npu.npu_fusion_attention(
            query.reshape(sq, batch, -1),
            key.reshape(sk, batch, -1),
            value.reshape(sk, batch, -1),
            heads,
            "SBH",
            atten_mask=mask,
            scale=softmax_scale,
            keep_prob=1.0 - dropout_p,
            pre_tockens=pre_tokens,
            next_tockens=next_tokens,
            sparse_mode=sparse_mode,
        )[0]
        if value_dim != head_dim:
            out = out.view(sq, batch, heads, head_dim)[..., :value_dim]
        return out.reshape(sq, batch, heads * value_dim)

    def _fused_attention_block(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        softmax_scale: float,
        causal: bool,
        band: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sq, batch, heads, head_dim = query.shape
        mask, sparse_mode, pre_tokens, next_tokens = _block_sparsity(sq, key.shape[0], query.device, causal, band)
        out, softmax_max, softmax_sum = self._torch_npu.npu_fusion_attention(
            query.reshape(sq, batch, -1),
            key.reshape(key.shape[0], batch, -1),
            value.reshape(value.shape[0], batch, -1),
            heads,
            "SBH",
            atten_mask=mask,
            scale=softmax_scale,
            keep_prob=1.0,
            pre_tockens=pre_tokens,
            next_tockens=next_tokens,
            sparse_mode=sparse_mode,
        )[:3]
        return out.view(sq, batch, heads, head_dim), softmax_max, softmax_sum

    def _fused_attention_block_grad(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        dout: torch.Tensor,
        out: torch.Tensor,
        softmax_max: torch.Tensor,
        softmax_sum: torch.Tensor,
        *,
        softmax_scale: float,
        causal: bool,
        band: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sq, batch, heads, _ = query.shape
        mask, sparse_mode, pre_tokens, next_tokens = _block_sparsity(sq, key.shape[0], query.device, causal, band)
        dq, dk, dv = self._torch_npu.npu_fusion_attention_grad(
            query.reshape(sq, batch, -1),
            key.reshape(key.shape[0], batch, -1),
            value.reshape(value.shape[0], batch, -1),
            dout.reshape(sq, batch, -1),
            heads,
            "SBH",
            softmax_max=softmax_max.contiguous(),
            softmax_sum=softmax_sum.contiguous(),
            atten_mask=mask,
            attention_in=out.reshape(sq, batch, -1),
            scale_value=softmax_scale,
            keep_prob=1.0,
            pre_tockens=pre_tokens,
            next_tockens=next_tokens,
            sparse_mode=sparse_mode,
        )[:3]
        return dq.view(query.shape), dk.view(key.shape), dv.view(value.shape)

    def _fused_attention_merge(
        self,
        out: torch.Tensor,
        softmax_max: torch.Tensor,
        softmax_sum: torch.Tensor,
        block_out: torch.Tensor,
        block_max: torch.Tensor,
        block_sum: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sq, batch = out.shape[:2]
        merged, new_max, new_sum = self._torch_npu.npu_ring_attention_update(
            out.reshape(sq, batch, -1),
            softmax_max.contiguous(),
            softmax_sum.contiguous(),
            block_out.reshape(sq, batch, -1),
            block_max.contiguous(),
            block_sum.contiguous(),
            input_layout="SBH",
        )
        return merged.view(out.shape), new_max, new_sum

    def _fused_grouped_matmul(
        self, x: torch.Tensor, weights: list[torch.Tensor], tokens_per_expert: list[int]
    ) -> torch.Tensor:
        return _NpuGroupedMatmul.apply(self, x, tokens_per_expert, *weights)

    def _grouped_matmul_rows(
        self, x: torch.Tensor, weights: list[torch.Tensor], groups: tuple[torch.Tensor, int]
    ) -> torch.Tensor:
        # group_type 0: x's rows in groups (groups: _group_list's); split_item 2: one output tensor
        group_list, group_list_type = groups
        return self._torch_npu.npu_grouped_matmul(
            [x], weights, group_list=group_list, split_item=2, group_type=0, group_list_type=group_list_type
        )[0]

    def _grouped_matmul_k(self, x_t: torch.Tensor, dy: torch.Tensor, groups: tuple[torch.Tensor, int]) -> torch.Tensor:
        # group_type 2: the shared K axis in groups: every group's x_i^T dy_i, stacked [groups, k, n]
        group_list, group_list_type = groups
        return self._torch_npu.npu_grouped_matmul(
            [x_t], [dy], group_list=group_list, split_item=3, group_type=2, group_list_type=group_list_type
        )[0]

    def profiler_activities(self) -> list:
        activity = self._torch_npu.profiler.ProfilerActivity
        return [activity.CPU, activity.NPU]

    #: torch_npu's trace handler writes NAME_*_ascend_pt/ (its ASCEND_PROFILER_OUTPUT parsed on the spot), the
    #: layout MindStudio Insight and msprof-analyze read; a Chrome trace alone shows neither HCCL nor AI Core tasks.
    profiler_output = "MindStudio Insight"

    def profiler(self, trace_dir: str | None = None, name: str = "trace") -> Any:
        # torch_npu's own profiler: torch.profiler does not see NPU kernels or HCCL tasks.
        if trace_dir is None:
            return self._torch_npu.profiler.profile(activities=self.profiler_activities())
        handler = self._torch_npu.profiler.tensorboard_trace_handler(trace_dir, worker_name=name)
        return self._torch_npu.profiler.profile(activities=self.profiler_activities(), on_trace_ready=handler)

    def peak_tflops(self, dtype: torch.dtype = torch.bfloat16) -> float | None:
        if dtype not in (torch.bfloat16, torch.float16):
            return None
        name = self.device_name()
        return next((peak for key, peak in self.facts.peak_tflops_bf16.items() if key in name), None)

    def versions(self) -> dict[str, str]:
        found = {"torch_npu": getattr(self._torch_npu, "__version__", "unknown")}
        cann = _cann_version()
        if cann:
            found["cann"] = cann
        return found


class _NpuGroupedMatmul(torch.autograd.Function):
    """y_i = x_i w_i^T on torch_npu's grouped matmul, which has no autograd formula of its own:
    dx_i = dy_i w_i (grouped by rows again), dw_i = (x_i^T dy_i)^T (grouped along K)."""

    @staticmethod
    def forward(
        ctx: Any, accelerator: NpuAccelerator, x: torch.Tensor, counts: list[int], *weights: torch.Tensor
    ) -> Any:
        groups = _group_list(counts, x.device)
        ctx.accelerator, ctx.groups = accelerator, groups
        ctx.save_for_backward(x, *weights)
        return accelerator._grouped_matmul_rows(x, [w.t() for w in weights], groups)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, *weights = ctx.saved_tensors
        dx = ctx.accelerator._grouped_matmul_rows(dy, list(weights), ctx.groups)
        dw = ctx.accelerator._grouped_matmul_k(x.t(), dy, ctx.groups)
        return None, dx, None, *(g.t() for g in dw)


def _group_list(counts: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """(group_list, group_list_type) of npu_grouped_matmul for these group sizes: the sizes (type 1), but one group
    (one local expert: --num-experts equal to the EP size) as its cumulative form (type 0), since CANN documents
    "当group_list_type为1时, group_list必须为非负数列, 且长度不能为1" (tests/accelerator/test_npu_reference.py)."""
    group_list = torch.tensor(counts, dtype=torch.int64, device=device)
    return (group_list, 1) if len(counts) > 1 else (group_list.cumsum(0), 0)


# sparse_mode 4 (band) reads a compressed lower-triangular atten_mask of this size (CANN's documentation)
_COMPRESSED_MASK = 2048


def _attention_sparsity(
    sq: int,
    sk: int,
    device: torch.device,
    attention_mask: torch.Tensor | None,
    window: tuple[int, int] | None,
) -> tuple[torch.Tensor | None, int, int, int]:
    """(atten_mask, sparse_mode, pre_tockens, next_tockens) of npu_fusion_attention for megatron's masks.

    CANN's npu_fusion_attention: sparse_mode 0 (defaultMask) applies a full atten_mask (True = masked;
    SS, 11SS or B1SS) within the pre_tockens / next_tockens band; sparse_mode 4 (band) keeps pre_tockens
    keys before and next_tockens after the diagonal over the compressed 2048 x 2048 lower-triangular mask.
    A sliding window (left, right) -> the band; a given mask (document masks: [b, 1, sq, sk], the causal
    triangle included) -> sparse_mode 0 with it and every key in the band; neither -> the causal triangle.
    """
    if window is not None:
        return _compressed_mask(device), 4, window[0], window[1]
    if attention_mask is not None:
        return attention_mask.bool(), 0, _ALL_TOKENS, _ALL_TOKENS
    return _causal_mask(sq, sk, device, True), 0, _ALL_TOKENS, 0


def _compressed_mask(device: torch.device) -> torch.Tensor:
    """The compressed 2048 x 2048 lower-triangular atten_mask sparse modes 2-4 read (True = masked)."""
    return torch.triu(torch.ones(_COMPRESSED_MASK, _COMPRESSED_MASK, dtype=torch.bool, device=device), diagonal=1)


def _block_sparsity(
    sq: int, sk: int, device: torch.device, causal: bool, band: tuple[int, int] | None
) -> tuple[torch.Tensor | None, int, int, int]:
    """(atten_mask, sparse_mode, pre_tockens, next_tockens) of a context-parallel block: the causal triangle
    (sparse_mode 0 with the full mask), every key (no mask), or a band (pre, next) around the block's top-left
    diagonal (key j seen by query i iff i - pre <= j <= i + next) as sparse_mode 4, whose band CANN documents
    "参数起点为右下角": around the diagonal through the bottom-right corner, j - i = sk - sq, hence the shift."""
    if band is None:
        return _causal_mask(sq, sk, device, causal), 0, _ALL_TOKENS, 0 if causal else _ALL_TOKENS
    corner = sk - sq
    return _compressed_mask(device), 4, band[0] + corner, band[1] - corner


def _causal_mask(sq: int, sk: int, device: torch.device, causal: bool) -> torch.Tensor | None:
    """The causal mask of npu_fusion_attention: True = masked (the upper triangle); None: every key."""
    return torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=device), diagonal=1) if causal else None


def _cann_version() -> str | None:
    """CANN's version from its install tree (ASCEND_HOME_PATH or the default)."""
    home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
    candidates = [home] if home else []
    candidates.append("/usr/local/Ascend/ascend-toolkit/latest")
    for root in candidates:
        for name in ("version.cfg", "compiler/version.info", "runtime/version.info"):
            path = os.path.join(root, name)
            if os.path.isfile(path):
                with open(path, encoding="utf-8", errors="replace") as handle:
                    for line in handle:
                        if "version" in line.lower() and "=" in line:
                            return line.split("=", 1)[1].strip()
    return None
