"""The checkpoint section: where and how often the run saves, what it loads, the checkpoint format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...fates import FlagPolicy
from .base import Section, spec


@dataclass(frozen=True, kw_only=True)
class CheckpointSection(Section):
    """Where and how often checkpoints are saved, what is loaded, and their format (Megatron-LM's CheckpointConfig)."""

    save: str | None = None
    """Output directory to save checkpoints to."""

    save_interval: int | None = spec(None, "--save-interval", "--persistent-save-interval")
    """Number of iterations between persistent checkpoint saves."""

    save_retain_interval: int | None = spec(
        None, fates=(FlagPolicy("--save-retain-interval", "ignored", "every saved checkpoint is kept"),)
    )
    """Number of iterations between retained checkpoints (other checkpoints except the last checkpoint are
    automatically deleted).
    """

    no_save_optim: bool | None = None
    """Do not save current optimizer."""

    no_save_rng: bool | None = None
    """Do not save current rng state."""

    load: str | None = None
    """Directory containing a model checkpoint."""

    no_load_optim: bool | None = None
    """Do not load optimizer when loading checkpoint."""

    no_load_rng: bool | None = None
    """Do not load rng state when loading checkpoint."""

    finetune: bool = False
    """Load model for finetuning. Do not load optimizer or rng state from checkpoint and set iteration to 0.
    Assumed when loading a release checkpoint.
    """

    pretrained_checkpoint: str | None = spec(
        None,
        fates=(
            FlagPolicy(
                "--pretrained-checkpoint",
                "refused",
                "loading from a second checkpoint root is not supported",
                "use --load DIR --finetune",
            ),
        ),
    )
    """Directory containing a pretrained model checkpoint for finetuning."""

    ckpt_step: int | None = None
    """Checkpoint step to load model from."""

    perform_initialization: bool = spec(True, "--no-initialization")
    """Controls weights initialization. This option can be useful when you know you are going to load values from a
    checkpoint.
    """

    use_checkpoint_args: bool = spec(
        False,
        fates=(
            FlagPolicy(
                "--use-checkpoint-args",
                "ignored",
                "model arguments are not read back from the checkpoint; pass them on the command line",
            ),
        ),
    )
    """Override model-related command-line arguments with arguments from checkpoint"""

    use_mp_args_from_checkpoint_args: bool = spec(
        False,
        fates=(
            FlagPolicy(
                "--use-mp-args-from-checkpoint-args", "ignored", "parallel sizes are not read back from the checkpoint"
            ),
        ),
    )
    """Copy model parallelism command-line arguments from checkpoint"""

    exit_on_missing_checkpoint: bool = False
    """If 'load' is set, but checkpoint is not found (e.g., path typo), then exit instead of random initialization."""

    use_dist_ckpt_deprecated: bool = spec(
        False,
        "--use-dist-ckpt",
        fates=(
            FlagPolicy(
                "--use-dist-ckpt",
                "ignored",
                "deprecated in Megatron-LM; --ckpt-format torch_dist is always distributed",
            ),
        ),
    )
    """Deprecated: see --ckpt-format."""

    auto_detect_ckpt_format: bool = False
    """Determine if the checkpoint format is in legacy or distributed format. If False, expects distributed
    checkpoint iff args.ckpt_format != "torch". Might slow down loading a bit (double rank0 ckpt load).
    """

    dist_ckpt_format_deprecated: str | None = spec(
        None,
        "--dist-ckpt-format",
        fates=(FlagPolicy("--dist-ckpt-format", "ignored", "deprecated in Megatron-LM; see --ckpt-format"),),
    )
    """Deprecated: see --ckpt-format."""

    ckpt_format: Literal["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"] = spec(
        "torch_dist",
        fates=(
            FlagPolicy(
                "--ckpt-format",
                "refused",
                "only the torch_dist distributed checkpoint format (and fsdp_dtensor under --use-megatron-fsdp) is supported",
                "use --ckpt-format torch_dist (the default)",
                allowed=("torch_dist", "fsdp_dtensor"),
            ),
        ),
    )
    """Checkpoint format: torch_dist, or fsdp_dtensor under --use-megatron-fsdp."""

    ckpt_fully_parallel_save_deprecated: bool = spec(
        False,
        "--ckpt-fully-parallel-save",
        fates=(
            FlagPolicy(
                "--ckpt-fully-parallel-save", "ignored", "deprecated in Megatron-LM; fully parallel save is the default"
            ),
        ),
    )
    """Deprecated: see --no-ckpt-fully-parallel-save."""

    ckpt_fully_parallel_save: bool = spec(True, "--no-ckpt-fully-parallel-save", "--disable-ckpt-fully-parallel-save")
    """Disable applying full save parallelization across DP for distributed checkpoints. Depending on ckpt format
    might decrease the number of files in the checkpoint. (Here the distributed optimizer's state is saved fully
    reshardable either way, so the checkpoint stays reshardable.)
    """

    ckpt_fully_parallel_load: bool = False
    """Apply full load parallelization across DP for distributed checkpoints."""

    async_save: bool = False
    """Apply async checkpointing save. Currently works only with `torch_dist` distributed checkpoint format.
    (Megatron-LM core_v0.16.1 turns it off without --use-persistent-ckpt-worker; this trainer writes with
    megatron-core's default forked writer.)
    """

    ckpt_assume_constant_structure: bool = spec(
        False, fates=(FlagPolicy("--ckpt-assume-constant-structure", "ignored", "each save builds its plan afresh"),)
    )
    """Assume the checkpoint structure is constant across saves to enable optimizations."""

    dist_ckpt_strictness: Literal[
        "assume_ok_unexpected",
        "log_unexpected",
        "log_all",
        "raise_unexpected",
        "raise_all",
        "return_unexpected",
        "return_all",
        "ignore_all",
    ] = "assume_ok_unexpected"
    """Determine handling of key mismatch during checkpoint load. Check StrictHandling docs for flags meaning.
    NOTE: This flag controls only distributed checkpoint load from storage, not loading state dict into the
    model.
    """
