"""Hugging Face checkpoints in and out: ``megatron-npu convert`` (see cli.py)."""
