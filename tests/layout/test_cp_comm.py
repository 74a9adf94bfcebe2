"""megatron_npu/layout/cp_comm.py: CP traffic per layer and where TP x CP ranks sit. The bytes are
also checked against what the CP attention hands to torch.distributed (tests/ops/test_context_parallel.py)."""

from __future__ import annotations

import types

import pytest

from megatron_npu.layout.cp_comm import CpTraffic, cp_traffic, placement_note, split_sizes

# LLaMA2-7B-like layer at 32k tokens, TP2 x CP4, bf16
SHAPE = dict(seq_length=32768, micro_batch_size=1, num_attention_heads=32, num_query_groups=32, head_dim=128, tp=2)


def test_ring_moves_kv_blocks_forward_and_kv_plus_fp32_gradients_backward():
    traffic = cp_traffic(**SHAPE, cp=4, comm_type="p2p")
    block = 2 * (32768 // 4) * 16 * 128  # k and v of this rank's 8k tokens, 16 heads per TP rank
    assert traffic == CpTraffic(ring_forward=3 * block * 2, ring_backward=3 * block * 2 + 4 * block * 4)
    assert traffic.forward == 3 * block * 2 and traffic.a2a_forward == 0


def test_ulysses_moves_three_quarters_of_q_k_v_and_the_output_each_way():
    traffic = cp_traffic(**SHAPE, cp=4, comm_type="a2a")
    tensor = (32768 // 4) * 16 * 128 * 2  # bytes of q (and of k, v, out) on this rank
    assert traffic.ring_forward == traffic.ring_backward == 0
    assert traffic.a2a_forward == traffic.a2a_backward == 4 * tensor * 3 // 4


def test_hierarchical_is_an_a2a_inside_and_a_ring_across():
    assert split_sizes("a2a+p2p", 4, [2, 2]) == (2, 2)
    both = cp_traffic(**SHAPE, cp=4, comm_type="a2a+p2p", hierarchical_sizes=[2, 2])
    assert both.ring_forward == cp_traffic(**SHAPE, cp=2, comm_type="p2p").ring_forward // 2 * 1
    assert both.a2a_forward == cp_traffic(**SHAPE, cp=4, comm_type="a2a").a2a_forward * 2 // 3
    with pytest.raises(ValueError, match="product is CP"):
        split_sizes("a2a+p2p", 4, [2, 4])
    assert cp_traffic(**SHAPE, cp=1) == CpTraffic()


def test_tp_x_cp_inside_a_node_or_one_line_saying_what_fits():
    assert placement_note(tp=2, cp=4, nproc_per_node=8) is None
    note = placement_note(tp=4, cp=4, nproc_per_node=8)
    assert note.startswith("TP 4 x CP 4 = 16 ranks do not fit in a node of 8") and "CP sizes that keep" in note
    assert note.split("inside a node: ")[1].startswith("1, 2 ")
    assert placement_note(tp=8, cp=1, nproc_per_node=8) is None


# multi-latent attention's core attention at CP2: 4 heads, q/k 16 + 8 RoPE channels, v 16, bf16
MLA_HEADS, MLA_QK, MLA_V, CHUNK, BATCH = 4, 24, 16, 4, 2


class _Group:
    """A process group's size, for ContextParallelAttention's layout checks (no process group exists)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _counted_cp_attention(comm_type: str, rank: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Bytes one rank of a CP2 group hands to send / all-to-all in ops/context_parallel.py's forward and backward,
    in-process: the ring's shift and the all-to-all are replaced by counters that return the tensor they
    were given (the shapes of what a peer would send back), every computation left as it runs."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_npu.ops import context_parallel, cp_ring

    sent = {"forward": 0, "backward": 0}
    phase = ["forward"]

    class CountingRing(cp_ring.Ring):
        def __init__(self, group: _Group | None) -> None:
            self.group, self.size, self.rank = None, 1 if group is None else group.size(), rank

        def shift(self, tensor):
            sent[phase[0]] += tensor.nbytes
            return tensor.clone(), []

    def all_to_all(parts, group):
        sent[phase[0]] += parts.nbytes * (group.size() - 1) // group.size()
        return parts.clone()

    monkeypatch.setattr(context_parallel, "Ring", CountingRing)
    monkeypatch.setattr(context_parallel, "_all_to_all", all_to_all)
    # the module's torch.distributed: only the groups' sizes are asked for (no process group exists)
    monkeypatch.setattr(context_parallel, "dist", types.SimpleNamespace(get_world_size=lambda group: group.size()))
    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=MLA_HEADS,
        context_parallel_size=2,
        cp_comm_type=comm_type,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    groups = type("Groups", (), {"tp": _Group(1), "cp": _Group(2)})()
    core = context_parallel.ContextParallelAttention(
        config, 1, AttnMaskType.causal, "self", pg_collection=groups, k_channels=MLA_QK, v_channels=MLA_V
    )
    g = torch.Generator().manual_seed(rank)
    shape = (2 * CHUNK, BATCH, MLA_HEADS)
    q, k, v = (torch.randn(*shape, d, generator=g, dtype=torch.bfloat16) for d in (MLA_QK, MLA_QK, MLA_V))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = core(q, k, v, None)
    phase[0] = "backward"
    out.float().square().sum().backward()
    return sent


@pytest.mark.parametrize("comm_type", ["p2p", "a2a"])
@pytest.mark.parametrize("rank", [0, 1])
def test_mla_bytes_are_what_the_cp_attention_sends_with_its_two_head_sizes(comm_type, rank, monkeypatch):
    """MLA's K travels at q/k's head size (qk_head_dim + qk_pos_emb_head_dim), V and the output at v_head_dim:
    the plan equals the bytes ops/cp_ring.py and the all-to-alls hand over, and one head size cannot give them."""
    sent = _counted_cp_attention(comm_type, rank, monkeypatch)
    shape = dict(seq_length=2 * 2 * CHUNK, micro_batch_size=BATCH, num_attention_heads=MLA_HEADS, tp=1, cp=2)
    planned = cp_traffic(**shape, num_query_groups=MLA_HEADS, head_dim=MLA_QK, v_head_dim=MLA_V, comm_type=comm_type)
    assert sent == {"forward": planned.forward, "backward": planned.backward}
    tokens_heads = 2 * CHUNK * BATCH * MLA_HEADS
    if comm_type == "p2p":  # K and V side by side (bf16) once forward, once backward, the fp32 dK/dV twice
        assert planned.backward == tokens_heads * (MLA_QK + MLA_V) * (2 + 2 * 4)
    for one_size in (MLA_QK, MLA_V):
        single = cp_traffic(**shape, num_query_groups=MLA_HEADS, head_dim=one_size, comm_type=comm_type)
        assert single.forward != sent["forward"]


def test_the_planner_prices_mla_cp_traffic_with_both_head_sizes():
    from megatron_npu.layout.planner import ModelSpec, ParallelSpec, plan
    from megatron_npu.layout.rankmap import build_rank_map

    mla = dict(multi_latent_attention=True, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, kv_lora_rank=16)
    model = ModelSpec(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,  # MLA has no query groups: every head its own k and v
        seq_length=32,
        micro_batch_size=2,
        global_batch_size=4,
        vocab_size=128,
        params_dtype="fp32",
        **mla,
    )
    cp = plan(model, build_rank_map(cp=2, nnodes=1, nproc_per_node=2), ParallelSpec()).ranks[0].by_label()["cp"]
    per_layer = cp_traffic(
        seq_length=32,
        micro_batch_size=2,
        num_attention_heads=4,
        num_query_groups=4,
        head_dim=24,
        v_head_dim=16,
        tp=1,
        cp=2,
        dtype_bytes=4,
    )
    # 2 layers x 2 micro-batches; a rank receives what it sends
    assert cp["bytes"] == 2 * 2 * 2 * (per_layer.forward + per_layer.backward)
