import os
import sys
from pathlib import Path

import pytest

# Tests run on the cpu target unless a test says otherwise; set before megatron_npu imports.
os.environ.setdefault("MEGATRON_NPU_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def model_parallel():
    """megatron-core's modules read their groups (TP, EP, ...) from parallel_state: a 1-rank gloo
    world in this process, for tests of single modules."""
    import torch.distributed as dist
    from distributed import free_port
    from megatron.core import parallel_state, tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
