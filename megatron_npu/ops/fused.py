"""Fused kernels for the math megatron-core computes unfused, each with its torch twin.

The accelerator says which fusions its device has (``fused_ops()``) and hands out the
kernel (``fused_kernel(key)``); where it has none, the torch function here runs the
same math as megatron-core's unfused path. ``megatron_npu/patches/fused_ops.py`` fills
megatron-core's fused-RoPE slot with ``rotary`` where the device has the kernel (used
only when the fusion flag is set); the RMSNorm and SwiGLU modules and the fused
attention are handed out by megatron_npu/ops/spec_provider.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from megatron_npu.accelerator import get_accelerator


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def fused_rotary_serves(interleaved: bool) -> bool:
    """Whether the device's RoPE kernel serves this layout: it rotates half-split channels only, so
    --rotary-interleaved runs megatron's unfused math (decided here for the config and the patch)."""
    return get_accelerator().has_fused_rotary and not interleaved


def rotary(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``freqs.shape[-1]`` channels of ``t`` (half-split, not interleaved)."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    kernel = get_accelerator().fused_kernel("rotary")
    if kernel is not None:
        rotated = kernel(t_rot, cos, sin)
    else:
        rotated = t_rot * cos + _rotate_half(t_rot) * sin
    return torch.cat((rotated, t_pass), dim=-1) if t_pass.shape[-1] else rotated


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half of the last dimension (megatron's gated linear unit)."""
    kernel = get_accelerator().fused_kernel("swiglu")
    if kernel is not None:
        return kernel(x)
    gate, linear = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    kernel = get_accelerator().fused_kernel("rms_norm")
    if kernel is not None:
        return kernel(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


class SwiGLU(torch.nn.Module):
    """megatron's gated SwiGLU as a module (the MLP's spec'd activation): the device kernel where there is one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """No state: megatron's MLP asks every child for its dist-checkpoint shards."""
        return {}


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm whose forward runs the device's fused kernel where there is one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps if self.eps is not None else torch.finfo(x.dtype).eps)


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    softmax_scale: float,
    dropout_p: float = 0.0,
    attention_mask: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Causal attention. query [sq, b, np, hq], key [sk, b, ng, hq], value [sk, b, ng, hv] (ng | np;
    MLA: hv != hq) -> [sq, b, np * hv]. ``attention_mask``: megatron's, True = masked, broadcastable
    to [b, 1, sq, sk] (document masks; it already holds the causal triangle); ``window``: megatron's
    sliding window (left, right): key j of query i attends when i - left <= j <= i + right."""
    sq, batch, heads, _ = query.shape
    kernel = get_accelerator().fused_kernel("flash_attention")
    if kernel is not None:
        return kernel(
            query,
            key,
            value,
            softmax_scale=softmax_scale,
            dropout_p=dropout_p,
            attention_mask=attention_mask,
            window=window,
        )
    groups = heads // key.shape[2]
    q = query.permute(1, 2, 0, 3)
    k = key.repeat_interleave(groups, dim=2).permute(1, 2, 0, 3)
    v = value.repeat_interleave(groups, dim=2).permute(1, 2, 0, 3)
    masked = attention_mask_of(sq, key.shape[0], query.device, attention_mask, window)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=~masked, dropout_p=dropout_p, scale=softmax_scale)
    return out.permute(2, 0, 1, 3).reshape(sq, batch, heads * value.shape[-1])


def attention_mask_of(
    sq: int,
    sk: int,
    device: torch.device,
    attention_mask: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The boolean mask (True = masked) flash_attention applies: the window's band, else the given
    mask, else the causal upper triangle (megatron-core's FusedScaleMaskSoftmax order)."""
    if window is not None:
        rows = torch.arange(sq, device=device).view(-1, 1) + (sk - sq)
        cols = torch.arange(sk, device=device).view(1, -1)
        return (cols < rows - window[0]) | (cols > rows + window[1])
    if attention_mask is not None:
        return attention_mask.bool()
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(diagonal=1)
