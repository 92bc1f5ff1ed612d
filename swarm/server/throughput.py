"""Measuring how fast a span computes, so clients can prefer fast servers."""
from __future__ import annotations

import logging
import time

import torch

from swarm.models.modules import BlockSpan
from swarm.utils.text import plural

logger = logging.getLogger(__name__)

REFERENCE_TOKENS = 128


@torch.inference_mode()
def measure_throughput(span: BlockSpan, device: str = "cpu", repeats: int = 3) -> float:
    """Tokens per second through the whole span for one sequence of 128 tokens (best of ``repeats``)."""
    param = next(span.parameters())
    hidden = torch.randn(1, REFERENCE_TOKENS, span.config.hidden_size, device=param.device, dtype=param.dtype)
    span(hidden)  # warm-up: first calls allocate and pick kernels
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        span(hidden)
        best = min(best, time.perf_counter() - started)
    throughput = REFERENCE_TOKENS / max(best, 1e-6)
    logger.info("measured throughput: %.0f tokens/s over %s", throughput, plural(span.end - span.start, "block"))
    return throughput
