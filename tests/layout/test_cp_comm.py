"""megatron_npu/layout/cp_comm.py: CP traffic per layer and where TP x CP ranks sit. The bytes are
also checked against what the CP attention hands to torch.distributed (tests/ops/test_context_parallel.py)."""

from __future__ import annotations

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
