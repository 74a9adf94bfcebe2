"""Datasets, samplers and per-model-chunk data iterators, as Megatron-LM builds them.

Only ranks whose model chunk embeds tokens (first pipeline stage) or computes the
loss (last stage) read data; the others get ``None`` iterators. Under the
interleaved pipeline every data-reading chunk gets its own iterator over the same
sample sequence: the schedule calls each chunk's forward step once per
microbatch, in microbatch order.
"""

from __future__ import annotations

import functools
import signal
import time
from collections.abc import Iterator

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list

from megatron_npu.accelerator import get_accelerator
from megatron_npu.compat import parallel_state  # megatron-core's; vp_stage on 0.12 too
from megatron_npu.training.run_state import RunState
from megatron_npu.training.sections import DataSection, ScheduleSection


def train_valid_test_num_samples(schedule: ScheduleSection) -> list[int]:
    """Megatron-LM's sample counts: eval runs every eval_interval, plus once at the end."""
    if schedule.train_samples:
        train_samples = schedule.train_samples
    else:
        train_samples = sum(schedule.global_batch_size_at(i) for i in range(1, schedule.train_iters + 1))
    eval_runs = (schedule.train_iters // schedule.eval_interval + 1) if schedule.train_iters else 1
    eval_samples = eval_runs * schedule.eval_iters * schedule.global_batch_size
    return [train_samples, eval_samples, schedule.eval_iters * schedule.global_batch_size]


def is_dataset_built_on_rank() -> bool:
    """Some model chunk of this rank reads data (first or last pipeline stage)."""
    return chunk_reads_data(None)


def gpt_dataset_config(data: DataSection, seed: int, tokenizer: object) -> GPTDatasetConfig:
    per_split = [
        get_blend_from_list(_list(p)) for p in (data.train_data_path, data.valid_data_path, data.test_data_path)
    ]
    use_per_split = any(blend is not None for blend in per_split)
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=data.seq_length,
        blend=None if (data.mock_data or use_per_split) else get_blend_from_list(_list(data.data_path)),
        blend_per_split=per_split if use_per_split and not data.mock_data else None,
        split=data.split,
        path_to_cache=data.data_cache_path,
        mmap_bin_files=data.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=data.reset_attention_mask,
        num_dataset_builder_threads=data.num_dataset_builder_threads,
    )


def _list(paths: tuple[str, ...] | None) -> list[str] | None:
    """A section's paths as the list megatron-core's get_blend_from_list reads (sections hold tuples)."""
    return None if paths is None else list(paths)


def build_datasets(data: DataSection, seed: int, tokenizer: object, num_samples: list[int]) -> list:
    """(train, valid, test) datasets; called on every rank (the builder synchronises)."""
    config = gpt_dataset_config(data, seed, tokenizer)
    dataset_cls = MockGPTDataset if data.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_cls, num_samples, is_dataset_built_on_rank, config).build()


class PretrainingSampler:
    """Micro-batches of sample indices for one DP rank, resumable at any consumed count.

    The global order is the dataset's; DP rank r takes slice r of each
    ``micro_batch_size * dp`` block (Megatron-LM's MegatronPretrainingSampler).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.block = micro_batch_size * dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.block

    def __iter__(self) -> Iterator[list[int]]:
        start = self.dp_rank * self.micro_batch_size
        for block in range(self.consumed_samples, self.total_samples - self.block + 1, self.block):
            yield list(range(block + start, block + start + self.micro_batch_size))


class RandomSampler(PretrainingSampler):
    """``--dataloader-type cyclic``: Megatron-LM's MegatronPretrainingRandomSampler (data sharding on).

    Each DP rank owns a contiguous bucket of the epoch and visits it in a permutation
    seeded by the epoch number; epochs repeat without end. Resumes at any consumed count.
    """

    def __iter__(self) -> Iterator[list[int]]:
        active_total = self.total_samples - self.total_samples % self.block
        bucket_size = (self.total_samples // self.block) * self.micro_batch_size
        consumed = self.consumed_samples
        while True:
            epoch, in_epoch = divmod(consumed, active_total)
            permutation = torch.randperm(bucket_size, generator=torch.Generator().manual_seed(epoch)).tolist()
            start = self.dp_rank * bucket_size
            offset = in_epoch // (self.block // self.micro_batch_size)
            indices = [start + i for i in permutation[offset:]]
            for first in range(0, len(indices) - self.micro_batch_size + 1, self.micro_batch_size):
                consumed += self.block
                yield indices[first : first + self.micro_batch_size]
            consumed = (epoch + 1) * active_total


class CyclicSampler(PretrainingSampler):
    """Wraps around the dataset: validation reuses its samples across evaluations."""

    def __iter__(self) -> Iterator[list[int]]:
        consumed = self.consumed_samples
        while True:
            block = consumed % (self.total_samples - self.total_samples % self.block)
            start = block + self.dp_rank * self.micro_batch_size
            yield list(range(start, start + self.micro_batch_size))
            consumed += self.block


class _DelayedIterator:
    """Test-only slow loader (``--data-loader-delay-ms``): sleeps before each batch."""

    def __init__(self, inner: Iterator, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def __iter__(self) -> _DelayedIterator:
        return self

    def __next__(self) -> dict:
        time.sleep(self.delay_s)
        return next(self.inner)


def _ignore_exit_signal(signum: int, worker_id: int) -> None:
    """--exit-signal-handler: torchrun (or a scheduler) signals each rank's whole process group,
    loader workers included, and a worker killed by the signal fails its rank before the rank
    can save. The rank stops its workers itself when it exits."""
    del worker_id
    signal.signal(signum, signal.SIG_IGN)


def build_loader(
    dataset,
    consumed_samples: int,
    data: DataSection,
    schedule: ScheduleSection,
    seed: int,
    dp: int,
    cyclic: bool = False,
) -> Iterator | None:
    if dataset is None or len(dataset) == 0:
        return None
    sampler_cls = CyclicSampler if cyclic else RandomSampler if data.dataloader_type == "cyclic" else PretrainingSampler
    sampler = sampler_cls(
        len(dataset), consumed_samples, schedule.micro_batch_size, parallel_state.get_data_parallel_rank(), dp
    )
    exit_signal = schedule.exit_signal
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=data.num_workers,
        pin_memory=get_accelerator().supports_pinned_memory(),
        persistent_workers=data.num_workers > 0,
        # Its own generator: creating an iterator must not draw from the global RNG,
        # which (on cpu) is also the dropout RNG a resumed run restores.
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=functools.partial(_ignore_exit_signal, exit_signal) if schedule.exit_signal_handler else None,
    )
    iterator: Iterator = iter(loader)
    if data.data_loader_delay_ms:
        iterator = _DelayedIterator(iterator, data.data_loader_delay_ms / 1000.0)
    return iterator


def chunk_reads_data(vp_stage: int | None) -> bool:
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    return first or last


def build_iterators(
    datasets: list,
    num_chunks: int,
    state: RunState,
    *,
    data: DataSection,
    schedule: ScheduleSection,
    seed: int,
    dp: int,
) -> tuple[list[Iterator | None], list[Iterator | None], list[Iterator | None]]:
    """Per-chunk (train, valid, test) iterators, each from the run's position in its stream;
    None where the chunk reads no data."""
    train_ds, valid_ds, test_ds = datasets
    train, valid, test = [], [], []
    loader = functools.partial(build_loader, data=data, schedule=schedule, seed=seed, dp=dp)
    for chunk in range(num_chunks):
        vp_stage = chunk if num_chunks > 1 else None
        reads = chunk_reads_data(vp_stage)
        train.append(loader(train_ds, state.consumed_train_samples) if reads else None)
        valid.append(loader(valid_ds, state.consumed_valid_samples, cyclic=True) if reads else None)
        test.append(loader(test_ds, 0) if reads else None)
    return train, valid, test
