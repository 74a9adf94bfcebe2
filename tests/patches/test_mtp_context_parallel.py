"""megatron_npu/patches/mtp_context_parallel.py: the MTP loss's token count is the CP group's.

megatron-core divides each CP rank's MTP loss sum by that rank's count of rolled loss-mask tokens; the rank holding
the sequence's last token (which the roll drops) counts one fewer, so the ranks' average is not the sequence's mean.
Two CP ranks run here as threads of this process, each with its own gloo group on one HashStore: no launch. The
end-to-end check is tests/models/test_layouts.py's DeepSeek-V3-style CP2 row (MTP loss rel 3.5e-5 without the patch,
exact with it).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import megatron_npu  # noqa: F401  (patches on import)
from megatron_npu.patches.mtp_context_parallel import cp_share_of_count
from megatron_npu.registry import REGISTRY

CP = 2


def _on_cp_ranks(work) -> list:
    """``work(rank, group)`` on CP ranks as threads, each with its own gloo group of CP ranks; results by rank."""
    store, results, errors = dist.HashStore(), [None] * CP, []

    def run(rank: int) -> None:
        try:
            group = c10d.ProcessGroupGloo(dist.PrefixStore("cp", store), rank, CP, timedelta(seconds=60))
            results[rank] = work(rank, group)
        except Exception as error:  # reported by the test, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(CP)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


def _cp_rank_share(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's part of a sequence as get_batch_on_this_cp_rank splits it: chunks rank and 2 * CP - 1 - rank."""
    chunks = tensor.chunk(2 * CP)
    return torch.cat([chunks[rank], chunks[2 * CP - 1 - rank]])


def test_mtp_loss_averaged_over_cp_ranks_is_the_whole_sequence_mean():
    loss = torch.arange(1.0, 17.0) ** 0.5  # per-token MTP losses of a 16-token sequence
    mask = torch.ones(16)
    mask[-1] = 0  # the rolled loss mask: the roll drops the last token, which CP rank 0 holds
    whole_mean = (loss * mask).sum() / mask.sum()

    def per_rank_means(rank: int, group) -> tuple[float, float]:
        local_sum = (_cp_rank_share(loss, rank) * _cp_rank_share(mask, rank)).sum()
        count = _cp_rank_share(mask, rank).sum()
        return (local_sum / count).item(), (local_sum / cp_share_of_count(count, group)).item()

    means = _on_cp_ranks(per_rank_means)
    unpatched, patched = (sum(m[i] for m in means) / CP for i in (0, 1))
    assert abs(unpatched - whole_mean.item()) > 1e-3 * whole_mean.item()  # the defect: a mean of unequal means
    assert abs(patched - whole_mean.item()) <= 1e-6 * whole_mean.item(), (patched, whole_mean)


def test_counts_outside_context_parallelism_are_unchanged():
    count = torch.tensor(15.0)
    assert cp_share_of_count(count, None) is count
    single = c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
    assert cp_share_of_count(count, single) is count


def test_both_trainers_roll_through_the_patch():
    """gpt_model.py (0.14-0.16) and process_mtp_loss (0.17+) reach roll_tensor by name: the alias is replaced."""
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer import multi_token_prediction

    assert "roll_tensor.cp_token_count" in {patch.name for patch in REGISTRY.applied()}
    # gpt_model.py imports it by name up to 0.16; process_mtp_loss (0.17+) is in multi_token_prediction itself
    assert getattr(gpt_model, "roll_tensor", multi_token_prediction.roll_tensor) is multi_token_prediction.roll_tensor
    original = REGISTRY.original_attribute(multi_token_prediction, "roll_tensor")
    assert multi_token_prediction.roll_tensor is not original
    labels = torch.arange(12).view(2, 6)
    for got, expected in zip(multi_token_prediction.roll_tensor(labels), original(labels), strict=True):
        assert torch.equal(got, expected)  # one rank: megatron-core's own roll and count
