"""scripts/train_ddp.py: the seed's plain DDP loop runs under torchrun on the cpu target."""

import pytest
from distributed import ROOT, torchrun

pytestmark = pytest.mark.launch  # every test here starts processes


def test_ddp_loop_trains_and_keeps_replicas_identical():
    results = torchrun(ROOT / "scripts" / "train_ddp.py", "--epochs", "3", nproc=2, timeout=300).check().by_rank()
    assert set(results) == {0, 1}
    assert {r["backend"] for r in results.values()} == {"gloo"}
    losses = results[0]["losses"]
    assert losses[-1] < losses[0] * 0.95, losses
    assert results[0]["checksum"] == results[1]["checksum"], "DDP replicas diverged"
