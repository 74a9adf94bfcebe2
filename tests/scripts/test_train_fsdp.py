"""scripts/train_fsdp.py: the seed's loop with torch FSDP2 under torchrun on the cpu target (gloo):
2 ranks, each holding half of every parameter, train the 1-rank run's model with its losses."""

import pytest
from distributed import ROOT, torchrun

pytestmark = pytest.mark.launch  # every test here starts processes

SCRIPT = ROOT / "scripts" / "train_fsdp.py"


def test_two_sharded_ranks_train_the_one_rank_losses():
    one = torchrun(SCRIPT, "--epochs", "2", nproc=1, timeout=600).check()
    two = torchrun(SCRIPT, "--epochs", "2", nproc=2, timeout=600).check()
    alone, ranks = one.by_rank()[0], two.by_rank()
    assert set(ranks) == {0, 1} and {r["backend"] for r in ranks.values()} == {"gloo"}
    assert two.stdout.count("epoch ") == 2, "rank 0 prints one line per epoch"
    losses = alone["losses"]
    assert len(losses) == 2 * 512 // 32 and alone["epoch_losses"][-1] < alone["epoch_losses"][0] * 0.8
    for rank in ranks.values():
        assert rank["losses"] == pytest.approx(losses, rel=1e-5)
        assert rank["checksum"] == pytest.approx(alone["checksum"], rel=1e-5)
        assert rank["shard_numel"] * 2 == pytest.approx(rank["numel"], abs=8), "each rank holds half"
