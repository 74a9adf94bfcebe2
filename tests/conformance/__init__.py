"""megatron-core's own unit tests run on the patch layer (issue #27): ``python -m tests.conformance.run``."""
