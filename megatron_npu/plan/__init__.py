"""``megatron-npu plan``: the command above the layout library (megatron_npu/layout/).

``cli.py`` reads pretrain_gpt.py's flags (through the trainer's own parser) or a Hugging Face config
(through the converter's mapping) and prints the communication and memory of one layout;
``search.py`` is ``plan --search``. The arithmetic lives in megatron_npu/layout/, which imports
nothing from here (tests/test_import_graph.py).
"""
