"""Rank map for a layout: node, device and TP/PP/DP/CP groups per rank (megatron_npu.layout.rankmap)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_npu.layout.rankmap import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
