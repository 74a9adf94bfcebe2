"""Hugging Face checkpoints in and out: ``megatron-npu convert``, as a script.

python scripts/convert_hf.py to-megatron HF_DIR SAVE_DIR --tp 2 --pp 2
python scripts/convert_hf.py to-hf LOAD_DIR HF_OUT
"""

import sys

from megatron_npu.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
