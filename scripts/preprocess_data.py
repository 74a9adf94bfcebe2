"""Megatron-LM-compatible tools/preprocess_data.py: ``megatron-npu preprocess`` (megatron_npu.data.preprocess)."""

import sys

# This process is the megatron-npu command (megatron_npu.launched_by_command): importing the
# package does not apply the patch layer, so preprocessing starts without torch.
MEGATRON_NPU_LAUNCHER = True

if __name__ == "__main__":
    from megatron_npu.cli import main

    sys.exit(main(["preprocess", *sys.argv[1:]]))
