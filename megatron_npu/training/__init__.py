"""The Megatron-LM-compatible GPT trainer behind ``pretrain_gpt.py``.

Users' forks of Megatron-LM's pretrain_gpt.py call ``get_args()``, ``get_timers()``,
``get_tokenizer()`` and ``print_rank_0()``; they are here under the same names.
Importing this package is cheap (no torch, no megatron-core): the migration tool
uses its argument parser.
"""

from megatron_npu.training.global_vars import get_args, get_timers, get_tokenizer, print_rank_0, print_rank_last

__all__ = ["get_args", "get_timers", "get_tokenizer", "print_rank_0", "print_rank_last"]
