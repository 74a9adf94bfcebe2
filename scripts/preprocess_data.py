"""Megatron-LM-compatible tools/preprocess_data.py (see megatron_npu.data.preprocess)."""

import sys

from megatron_npu.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
