"""The distributed section: parallel degrees (``ParallelDims`` is their typed layout), the collective
backend, and the data-parallel and pipeline communication switches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...fates import CUDA_GRAPH, DROP, TE, FlagPolicy
from .base import Section, spec


@dataclass(frozen=True, kw_only=True)
class DistributedSection(Section):
    """Parallel degrees, the backend, and DDP / pipeline communication (Megatron-LM's distributed group;
    megatron-core's DistributedDataParallelConfig fields of the same names)."""

    tensor_model_parallel_size: int = 1
    """Intra-layer model parallelism. Splits tensors across ranks."""

    pipeline_model_parallel_size: int = 1
    """Inter-layer model parallelism. Splits transformer layers across ranks."""

    num_layers_per_virtual_pipeline_stage: int | None = None
    """Number of layers per virtual pipeline stage."""

    num_virtual_stages_per_pipeline_rank: int | None = None
    """Number of virtual pipeline stages per pipeline parallelism rank."""

    microbatch_group_size_per_vp_stage: int | None = spec(None, "--microbatch-group-size-per-virtual-pipeline-stage")
    """Contiguous microbatches per virtual pipeline stage; pipeline size if not given."""

    overlap_p2p_comm: bool = spec(True, "--no-overlap-p2p-communication")
    """Do not overlap pipeline communication with the forward and backward chunks in 1F1B."""

    overlap_p2p_comm_warmup_flush: bool = spec(False, "--overlap-p2p-communication-warmup-flush")
    """Overlap communication and computation in the warm-up and flush phases."""

    distributed_backend: Literal["nccl", "hccl", "gloo"] = spec(
        "nccl",
        fates=(
            FlagPolicy(
                "--distributed-backend",
                "mapped",
                "the accelerator runs the collectives: nccl (Megatron-LM's default) is HCCL on Ascend, gloo on the cpu target",
                migrate="rewrite",
                name="backend",
                rewrite="nccl=hccl",
            ),
        ),
    )
    """Collective backend; nccl is mapped to the device's backend (hccl on Ascend)."""

    distributed_timeout_minutes: float = 10  # Megatron-LM's is int; a fraction lets a test bound a hang in seconds
    """Timeout of each collective: a rank waiting longer on a hung one fails, and the job with it (fractions
    accepted: [megatron-npu extension])."""

    overlap_grad_reduce: bool = False
    """Overlap DDP grad reduce."""

    defer_embedding_wgrad_compute: bool = False
    """Defer the embedding's weight-gradient GEMMs to the pipeline flush."""

    wgrad_deferral_limit: int = 0
    """Micro-batches whose embedding weight-gradient compute is deferred (0: all)."""

    align_grad_reduce: bool = spec(True, "--no-align-grad-reduce")
    """Launch every pipeline stage's gradient reduce at the same time instead of each as needed."""

    ddp_num_buckets: int | None = spec(
        None, fates=(FlagPolicy("--ddp-num-buckets", "ignored", "use --ddp-bucket-size"),)
    )
    """Number of buckets for data-parallel communication."""

    ddp_bucket_size: int | None = None
    """Bucket size for data-parallel communication."""

    ddp_pad_buckets_for_high_nccl_busbw: bool = spec(
        False,
        fates=(
            FlagPolicy("--ddp-pad-buckets-for-high-nccl-busbw", "ignored", "an NCCL bus-bandwidth tuning; not applied"),
        ),
    )
    """Pad each bucket to a multiple of 2^16 (NCCL bus bandwidth at large DP counts)."""

    ddp_average_in_collective: bool = False
    """Average directly in the data-parallel collective."""

    overlap_param_gather: bool = False
    """Overlap param all-gather in distributed optimizer."""

    align_param_gather: bool = spec(True, "--no-align-param-gather")
    """Launch every pipeline stage's param all-gather at the same time instead of each as needed."""

    scatter_gather_tensors_in_pipeline: bool = spec(True, "--no-scatter-gather-tensors-in-pipeline")
    """Do not use scatter/gather to optimize communication of tensors in the pipeline."""

    local_rank: int = spec(0, env_default="LOCAL_RANK")
    """Local rank passed from the distributed launcher (default: $LOCAL_RANK)."""

    use_distributed_optimizer: bool = False
    """Use distributed optimizer."""

    num_distributed_optimizer_instances: int = spec(
        1,
        fates=(
            FlagPolicy(
                "--num-distributed-optimizer-instances",
                "refused",
                "one distributed-optimizer instance per DP group only",
                "use --num-distributed-optimizer-instances 1 (the default)",
                allowed=("1",),
            ),
        ),
    )
    """Number of distributed-optimizer copies across the data-parallel domain."""

    context_parallel_size: int = 1
    """Splits network input along sequence dimension across ranks."""

    cp_comm_type: tuple[str, ...] = ("p2p",)
    """Context parallelism's communication: p2p, a2a, allgather or a2a+p2p; one for all layers or one per layer."""

    hierarchical_context_parallel_sizes: tuple[int, ...] | None = None
    """Degrees of hierarchical context parallelism, one per level (a2a+p2p: the a2a group's, then the p2p's)."""

    use_tp_pp_dp_mapping: bool = spec(
        False,
        fates=(
            FlagPolicy(
                "--use-tp-pp-dp-mapping",
                "refused",
                "rank maps, rank tables and checks assume megatron-core's default order",
                "drop it (the order is tp-cp-ep-dp-pp)",
            ),
        ),
    )
    """Order ranks tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp."""

    expert_model_parallel_size: int = 1
    """Distributes MoE experts across a sub data-parallel dimension."""

    expert_tensor_parallel_size: int | None = None
    """Expert TP; --tensor-model-parallel-size if unset."""

    transformer_impl: Literal["local", "transformer_engine"] = spec(
        "local",
        fates=(
            FlagPolicy(
                "--transformer-impl",
                "refused",
                TE,
                "use --transformer-impl local (the default; `megatron-npu migrate` rewrites it)",
                allowed=("local",),
                migrate="rewrite",
                name="transformer-impl",
                rewrite="transformer_engine=local",
                scope="device",
            ),
        ),
    )
    """Transformer implementation; only local (the default here) is supported."""

    cuda_graph_impl: Literal["none", "local", "transformer_engine"] = spec(
        "none",
        fates=(
            FlagPolicy(
                "--cuda-graph-impl",
                "refused",
                CUDA_GRAPH,
                DROP,
                allowed=("none",),
                migrate="drop",
                name="cuda-graph-impl",
                takes_value=True,
                scope="device",
            ),
        ),
    )
    """CUDA graph capture implementation (none: no CUDA graph)."""
