"""Context parallelism in Megatron-LM core_v0.16.1's own trainer with ``--transformer-impl local``
(megatron_npu/patches/context_parallel.py gives the local spec megatron_npu's ContextParallelAttention).

From the same seed CP does not change the initial weights (megatron seeds by TP and PP rank) nor
the global batches, and attention over the split sequence is exact: CP2's per-iteration lm loss
equals CP1's (rel 1e-5). Dropout is off (the CP attention has none).
"""

from __future__ import annotations

import pytest
from megatron_lm_checkout import LOSS_LINE, NEEDS_EXTRACT, upstream
from pretrain_runs import MOCK_DATA, NO_DROPOUT
from pretrain_runs import MODEL as PROJECT_MODEL

pytestmark = [
    pytest.mark.launch,
    NEEDS_EXTRACT,
]

MODEL = [*PROJECT_MODEL, "--eval-interval", "1000", *NO_DROPOUT, *MOCK_DATA, "--train-iters", "4"]


def losses(stdout: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in map(LOSS_LINE.search, stdout.splitlines()) if m}


def test_cp2_ring_attention_trains_with_the_losses_of_cp1(megatron_lm):
    reference = losses(upstream(megatron_lm, *MODEL, nproc=1).check().stdout)
    job = upstream(megatron_lm, *MODEL, "--context-parallel-size", "2", "--cp-comm-type", "p2p", nproc=2).check()
    ring = losses(job.stdout)
    assert set(reference) == set(ring) == {1, 2, 3, 4}
    for iteration, loss in reference.items():
        assert abs(ring[iteration] - loss) <= 1e-5 * abs(loss), (iteration, ring[iteration], loss)
