import os
import sys
from pathlib import Path

# Tests run on the cpu target unless a test says otherwise; set before megatron_npu imports.
os.environ.setdefault("MEGATRON_NPU_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
