"""Megatron-LM core_v0.16.1's own pretrain_gpt.py with its FSDP flags, through ``-m megatron_npu.run``
(cpu target, gloo): Megatron-FSDP (``optim_grads_params``) and torch FSDP2 on 2 ranks train the
1-rank run's model with its losses (megatron_npu/patches/fsdp.py makes both run off CUDA).

Three launches: the 1-rank reference (Megatron-FSDP, one rank: the plain data-parallel math, since
megatron_npu/patches/fsdp.py makes a single rank's reduction the identity), Megatron-FSDP on 2 ranks, FSDP2 on 2
ranks. Embeddings are untied in all three (FSDP2 requires it), so the three train one model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import Job
from megatron_lm_checkout import LOSS_LINE, NEEDS_EXTRACT, upstream
from pretrain_runs import MOCK_DATA, NO_DROPOUT
from pretrain_runs import MODEL as PROJECT_MODEL

pytestmark = [
    pytest.mark.launch,
    NEEDS_EXTRACT,
]

MODEL = [
    *PROJECT_MODEL,
    *("--eval-interval", "1000", "--train-iters", "4", "--untie-embeddings-and-output-weights"),
    *NO_DROPOUT,
    *MOCK_DATA,
]
MEGATRON_FSDP = [
    "--use-megatron-fsdp",
    *("--data-parallel-sharding-strategy", "optim_grads_params"),
    "--use-distributed-optimizer",
    *("--ckpt-format", "fsdp_dtensor"),
]
TORCH_FSDP2 = ["--use-torch-fsdp2"]
RUNS: dict[str, Job] = {}


def losses(job: Job) -> dict[int, float]:
    found = {int(m.group(1)): float(m.group(2)) for m in map(LOSS_LINE.search, job.stdout.splitlines()) if m}
    assert found, f"no iteration lines\n{job.stdout[-3000:]}\n{job.stderr[-3000:]}"
    return found


@pytest.fixture(scope="module")
def reference(megatron_lm: Path) -> dict[int, float]:
    job = upstream(megatron_lm, *MODEL, *MEGATRON_FSDP, nproc=1).check()
    return losses(job)


@pytest.mark.parametrize(("flags", "name"), [(MEGATRON_FSDP, "megatron-fsdp"), (TORCH_FSDP2, "torch-fsdp2")])
def test_two_ranks_train_the_one_rank_losses(megatron_lm, reference, flags, name):
    job = upstream(megatron_lm, *MODEL, *flags, nproc=2).check()
    two = losses(job)
    assert sorted(two) == sorted(reference) == [1, 2, 3, 4]
    assert reference[4] < reference[1], "the reference trains"
    for iteration, expected in reference.items():
        assert two[iteration] == pytest.approx(expected, rel=1e-5), (name, iteration)
    assert "Traceback" not in job.stderr
