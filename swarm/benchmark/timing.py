"""Timing a call for the benchmarks: one warm-up, then the median of repeated runs."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def time_calls(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)
