"""Kernels plugged into megatron-core: norms and the torch_npu fused ops."""
