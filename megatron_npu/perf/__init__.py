"""Performance tools: the communication counter (``comm``) and ``megatron-npu perf-report``
(``report``: the command, over ``load`` -> ``checks`` -> ``render``)."""
