"""Performance tools: the communication counter (``comm``) behind the performance report."""
