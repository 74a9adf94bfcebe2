"""``python -m megatron_npu COMMAND``: the same as the ``megatron-npu`` command."""

import sys

from .cli import main

sys.exit(main())
