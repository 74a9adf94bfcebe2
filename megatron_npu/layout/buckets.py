"""megatron-core's DDP grad-buffer layout (``_ParamAndGradBuffer``), shared by the communication
planner (bucket sizes on the wire) and the memory model (buffer bytes, distributed-optimizer shards).
No torch import; checked against a real megatron-core DDP in tests/layout/test_layout.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Bucket:
    """One DDP bucket of a grad buffer: [start, end) elements, and its parameters' [start, end)."""

    start: int
    end: int
    params: list[tuple[str, int, int]] = field(default_factory=list)


def bucket_layout(
    params: list[tuple[str, int]], dp: int, dist_opt: bool, bucket_size: int | None, shared: set[str]
) -> list[Bucket]:
    """megatron-core _ParamAndGradBuffer's layout (elements): parameters in reverse order; under the
    distributed optimizer each parameter starts at a multiple of 64, each bucket ends at a multiple
    of lcm(DP, 128), and a shared embedding gets a bucket of its own."""
    divisor = math.lcm(dp, 128)
    buckets: list[Bucket] = []
    current = Bucket(0, 0)
    start = end = 0

    def close(param_end: int) -> int:
        nonlocal current
        current.end = math.ceil(param_end / divisor) * divisor if dist_opt else param_end
        buckets.append(current)
        current = Bucket(current.end, current.end)
        return current.start

    for name, numel in reversed(params):
        if dist_opt:
            start = math.ceil(start / 64) * 64
        own = dist_opt and name in shared
        if own and current.params:
            start = close(start)
        end = start + numel
        current.params.append((name, start, end))
        if (bucket_size is not None and end - current.start >= bucket_size) or own:
            start = close(end)
        else:
            start = end
    if current.params:
        close(end)
    return buckets
