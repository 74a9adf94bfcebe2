"""HCCL rank table (RANK_TABLE_FILE) from hosts and NPU NIC addresses (megatron_npu.layout.ranktable)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_npu.layout.ranktable import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
