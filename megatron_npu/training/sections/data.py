"""The data section: the datasets and their split, the sequence length, the data loader."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...fates import FlagPolicy
from .base import Section, spec


@dataclass(frozen=True, kw_only=True)
class DataSection(Section):
    """The datasets, their split, the sequence length and the data loader (Megatron-LM's data and dataloader flags)."""

    data_path: tuple[str, ...] | None = spec(None, nargs="*")
    """A prefix, prefixes, or weight-prefix pairs (w1 p1 w2 p2)."""

    split: str | None = None
    """e.g. 969,30,1 (the default with --data-path)."""

    train_data_path: tuple[str, ...] | None = spec(None, nargs="*")
    """The weight and prefix list for an independent train dataset. Follows the same pattern rules as --data-path."""

    valid_data_path: tuple[str, ...] | None = spec(None, nargs="*")
    """The weight and prefix list for an independent validation dataset. Follows the same pattern rules as --data-
    path.
    """

    test_data_path: tuple[str, ...] | None = spec(None, nargs="*")
    """The weight and prefix list for an independent test dataset. Follows the same pattern rules as --data-path."""

    data_cache_path: str | None = None
    """Path to a directory to hold cached index files."""

    mmap_bin_files: bool = spec(True, "--no-mmap-bin-files")
    """Disable mmap-ing of .bin files."""

    mock_data: bool = False
    """Skip data loading and validation and opt for artificial generation of mock data when an implementation is
    available.
    """

    seq_length: int | None = None
    """Maximum sequence length to process."""

    num_workers: int = 2
    """Dataloader number of workers."""

    dataloader_type: Literal["single", "cyclic", "external"] | None = spec(
        None,
        fates=(
            FlagPolicy(
                "--dataloader-type",
                "refused",
                "an external data loader needs code this trainer does not have",
                "use --dataloader-type single (the default) or cyclic",
                allowed=("single", "cyclic"),
            ),
        ),
    )
    """Single pass vs multiple pass data loader"""

    reset_position_ids: bool = False
    """Reset posistion ids after end-of-document token."""

    reset_attention_mask: bool = False
    """Reset self attention mask after end-of-document token."""

    eod_mask_loss: bool = False
    """Mask loss for the end of document tokens."""

    create_attention_mask_in_dataloader: bool = spec(
        True,
        "--no-create-attention-mask-in-dataloader",
        fates=(
            FlagPolicy(
                "--no-create-attention-mask-in-dataloader",
                "ignored",
                "the causal mask is built by the attention kernel",
            ),
        ),
    )
    """If set, do not create attention_masks in dataloader."""

    num_dataset_builder_threads: int = 1
    """Number of parallel threads per rank for dataset builder"""

    data_loader_delay_ms: float = spec(0.0, extension=True)
    """test only: sleep this long per batch to simulate a slow data loader."""
