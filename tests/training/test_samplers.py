"""Samplers of pretrain_gpt.py: every DP rank its share, resumable at any consumed-sample count."""

from __future__ import annotations

import itertools

import pytest

from megatron_npu.training.data import PretrainingSampler, RandomSampler

TOTAL, MBS, DP = 40, 2, 2
BLOCK = MBS * DP


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def test_single_sampler_splits_each_block_between_dp_ranks_in_order():
    ranks = [take(PretrainingSampler(TOTAL, 0, MBS, r, DP), 3) for r in range(DP)]
    assert ranks == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]]


@pytest.mark.parametrize("sampler_cls", [PretrainingSampler, RandomSampler])
def test_resuming_at_a_consumed_count_continues_the_same_sequence(sampler_cls):
    for rank in range(DP):
        continuous = take(sampler_cls(TOTAL, 0, MBS, rank, DP), 9)
        resumed = take(sampler_cls(TOTAL, 4 * BLOCK, MBS, rank, DP), 5)
        assert resumed == continuous[4:9]


def test_cyclic_sampler_visits_each_rank_bucket_once_per_epoch_in_a_new_order():
    steps_per_epoch = TOTAL // BLOCK
    for rank in range(DP):
        batches = take(RandomSampler(TOTAL, 0, MBS, rank, DP), 2 * steps_per_epoch)
        epoch0, epoch1 = batches[:steps_per_epoch], batches[steps_per_epoch:]
        bucket = list(range(rank * TOTAL // DP, (rank + 1) * TOTAL // DP))
        assert sorted(i for b in epoch0 for i in b) == bucket == sorted(i for b in epoch1 for i in b)
        assert epoch0 != epoch1
