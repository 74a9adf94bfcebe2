"""``--moe-grouped-gemm``: an MoE layer's local experts as two grouped GEMMs instead of one pair of
GEMMs per expert.

megatron-core 0.16.1's grouped expert modules need CUDA: GroupedMLP the ``grouped_gemm`` package,
TEGroupedMLP Transformer Engine. GroupedSequentialMLP keeps SequentialMLP's parameters (one
megatron-core MLP per local expert), so its checkpoint keys, and their resharding across EP sizes,
are SequentialMLP's; only the forward changes: fc1 of every local expert in one
``grouped_matmul``, the activation once over all rows, fc2 in one more. The grouped GEMM is the
accelerator's ``fused_kernel("grouped_matmul")`` (torch_npu's grouped matmul on npu) or, where the
device has none, the same math per expert, which is megatron-core's sequential path.

``gmm`` is the same grouped GEMM with the ``grouped_gemm`` package's signature (``ops.gmm``), which
megatron-core 0.12-0.16's legacy GroupedMLP calls; megatron_npu/patches/grouped_gemm.py hands it to
megatron-core where that package (CUDA kernels) is not installed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_npu.accelerator import get_accelerator


def grouped_matmul(x: torch.Tensor, weights: Sequence[torch.Tensor], tokens_per_expert: list[int]) -> torch.Tensor:
    """``x``'s rows in consecutive groups of ``tokens_per_expert``, group i times ``weights[i]``
    transposed (torch.nn.Linear's ``[out, in]`` layout): ``[sum(tokens), in] -> [sum(tokens), out]``."""
    kernel = get_accelerator().fused_kernel("grouped_matmul")
    if kernel is not None:
        return kernel(x, list(weights), tokens_per_expert)
    # megatron-core's expert linear layers: torch.matmul(input, weight.t()) each
    parts = torch.split(x, tokens_per_expert)
    return torch.cat([torch.matmul(part, weight.t()) for part, weight in zip(parts, weights, strict=True)])


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """``grouped_gemm.ops.gmm``: ``a``'s rows in groups of ``batch_sizes``, group i times ``b[i]``
    (``[experts, k, n]``; ``[experts, n, k]`` transposed under ``trans_b``): ``[tokens, k] -> [tokens, n]``."""
    per_expert = b.unbind(0)
    weights = per_expert if trans_b else [weight.t() for weight in per_expert]  # grouped_matmul takes [out, in]
    return grouped_matmul(a, weights, [int(n) for n in batch_sizes.tolist()])


class GroupedSequentialMLP(SequentialMLP):
    """SequentialMLP's experts, computed with grouped GEMMs (same parameters, same checkpoint)."""

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        experts: list[MLP] = list(self.local_experts)
        if not _groupable(experts[0]):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        hidden, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP (validated for top-1)
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        if len(experts) == 1:
            counts = [hidden.shape[0]]
        else:
            counts = [int(n) for n in tokens_per_expert.tolist()]
        fc1 = grouped_matmul(hidden, [e.linear_fc1.weight for e in experts], counts)
        activated = _activation(experts[0], fc1, probs)
        return grouped_matmul(activated, [e.linear_fc2.weight for e in experts], counts), None


def _groupable(expert: MLP) -> bool:
    """The configurations whose expert math is a plain GEMM, activation, GEMM (the rest: SequentialMLP)."""
    config = expert.config
    # bias_activation_fusion: megatron's TorchScript kernels, off wherever the patch set runs (lacks_jit_fusion)
    quantized_or_fused = config.fp8 or config.fp4 or config.bias_activation_fusion
    return not quantized_or_fused and expert.linear_fc1.bias is None and expert.linear_fc2.bias is None


def _activation(expert: MLP, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """megatron-core's MLP.forward between its two linear layers, unfused and without bias (row by
    row, so once for every expert's rows), scaled by each row's routing probability."""
    config = expert.config
    scale = probs.unsqueeze(-1)
    if config.use_te_activation_func:
        x = expert.activation_func(x)
    elif config.gated_linear_unit:
        gate, linear = torch.chunk(x, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate, linear = gate.clamp(min=None, max=clamp), linear.clamp(min=-clamp, max=clamp)
        x = config.activation_func(gate) * (linear + config.glu_linear_offset)
    else:
        x = expert.activation_func(x)
    return (x * scale).to(x.dtype)
