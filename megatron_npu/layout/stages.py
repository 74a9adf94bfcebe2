"""Which transformer layers each pipeline stage (and each of its model chunks) builds: megatron-core 0.16.1's
``get_transformer_layer_offset`` / ``get_num_layers_to_build`` rules, for the planner and the memory model.

Even split; uneven first / last stages (``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers``: the middle stages share the rest evenly, each stage's layers
split evenly over its virtual stages); the embedding and the loss counted as a layer each
(``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``: the first
virtual stage builds one layer fewer, the last one fewer); ``--pipeline-model-parallel-layout`` (each
virtual stage's ``t`` count). The rules' errors are ``ParallelDims.check_num_layers``'s.
"""

from __future__ import annotations

from megatron_npu.layout.parallel_dims import ParallelDims, layout_stages


def _layout_counts(layout: str) -> list[int]:
    """Decoder layers per virtual stage of --pipeline-model-parallel-layout (``t``; ``E``, ``L``, ``m`` are
    the embedding, the loss and MTP), after megatron-core's unrolling of ``(...)*n`` and ``x*n``."""
    return [stage.count("t") for stage in layout_stages(layout)]


def virtual_stage_layers(dims: ParallelDims, num_layers: int) -> list[int]:
    """Decoder layers of each virtual stage, in layer order (virtual stage ``c * PP + pp_rank``)."""
    pp, vpp = dims.pp, dims.virtual_stages
    layout = getattr(dims, "layout", None)
    if layout:
        return _layout_counts(layout)
    first, last = getattr(dims, "first_stage_layers", None), getattr(dims, "last_stage_layers", None)
    if first is not None or last is not None:
        middle_stages = pp - (first is not None) - (last is not None)
        middle = (num_layers - (first or 0) - (last or 0)) // middle_stages if middle_stages else 0
        per_rank = [middle] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
        return [per_rank[v % pp] // vpp for v in range(pp * vpp)]
    extra_first = int(getattr(dims, "embedding_in_split", False))
    extra_last = int(getattr(dims, "loss_in_split", False))
    per_vstage = (num_layers + extra_first + extra_last) // (pp * vpp)
    counts = [per_vstage] * (pp * vpp)
    counts[0] -= extra_first
    counts[-1] -= extra_last
    return counts


def chunk_layers(dims: ParallelDims, num_layers: int, pp_rank: int) -> list[tuple[int, int]]:
    """(first layer, layer count) of each model chunk of ``pp_rank``."""
    counts = virtual_stage_layers(dims, num_layers)
    offsets = [sum(counts[:v]) for v in range(len(counts))]
    return [(offsets[v], counts[v]) for v in range(pp_rank, len(counts), dims.pp)]
