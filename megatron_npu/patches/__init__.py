"""The patch set, one module per subsystem (installed as ``megatron_npu.patches``).

Importing this package registers every patch with ``megatron_npu.registry.REGISTRY``;
``megatron_npu.patch()`` applies them for the selected accelerator. On the cuda
target no patch applies: megatron-core runs as upstream.
"""

from . import (  # noqa: F401  (importing registers the patches)
    adam_step,
    attention,
    context_parallel,
    device_arguments,
    distributed,
    embeddings,
    fsdp,
    fused_ops,
    grouped_gemm,
    inference,
    mappings,
    megatron_core_fixes,
    megatron_training,
    moe,
    moe_expert_bias,
    mtp_context_parallel,
    optimizer,
    optimizer_cpu_offload,
    pipeline_parallel,
    release_fixes,
    tensor_parallel,
    torch_cuda,
    transformer,
    triton_imports,
    vision,
)
