"""Process-wide trainer state under Megatron-LM's accessor names."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

_STATE: dict[str, Any] = {}


def _get(name: str) -> Any:
    if name not in _STATE:
        raise RuntimeError(f"{name} is not initialised: call megatron_npu.training.pretrain() first")
    return _STATE[name]


def set_global(name: str, value: Any) -> None:
    _STATE[name] = value


def get_args() -> argparse.Namespace:
    """The run's settings (``Settings``, an argparse namespace), read-only once the run has started."""
    return _get("args")


def get_timers() -> Any:
    return _get("timers")


def get_tokenizer() -> Any:
    return _get("tokenizer")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def print_rank_0(message: str) -> None:
    if _rank() == 0:
        _write(message)


def print_rank_last(message: str) -> None:
    """Megatron-LM prints iteration lines from the last rank: it holds the loss."""
    if _rank() == _world_size() - 1:
        _write(message)


def _write(message: str) -> None:
    # One write per line: ranks share the launcher's stdout.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()
