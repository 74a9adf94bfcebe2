"""Run by a release venv's python: are two torch_dist checkpoints' tensors equal? Prints one RESULT line.

In the release's own environment, because a checkpoint pickles that release's classes (its args, enums).
Usage: python compare_checkpoints.py CKPT_A CKPT_B SCRATCH_DIR
"""

import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def tensors(checkpoint: str, scratch: Path) -> dict:
    dcp_to_torch_save(checkpoint, scratch)
    return {k: v for k, v in torch.load(scratch, weights_only=False).items() if isinstance(v, torch.Tensor)}


def main() -> None:
    first, second, scratch = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    a, b = tensors(first, scratch / "a.pt"), tensors(second, scratch / "b.pt")
    unequal = sorted(k for k in a.keys() & b.keys() if not torch.equal(a[k], b[k]))
    print("RESULT " + json.dumps({"rank": 0, "keys": len(a), "same_keys": a.keys() == b.keys(), "unequal": unequal}))


if __name__ == "__main__":
    main()
