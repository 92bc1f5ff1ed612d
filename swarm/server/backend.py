"""The compute side of a server: a loaded span, run on a worker thread, with bounded concurrency."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from swarm.models.modules import BlockSpan
from swarm.protocol import ErrorCode, RemoteError

logger = logging.getLogger(__name__)


class SpanBackend:
    """Runs forward passes of one span; refuses work beyond ``max_concurrent`` instead of queueing forever."""

    def __init__(self, span: BlockSpan, max_concurrent: int, device: str = "cpu",
                 max_queued_tokens: Optional[int] = None):
        self.span = span
        self.device = torch.device(device)
        self.dtype = next(span.parameters()).dtype
        self.max_concurrent = max_concurrent
        self.max_queued_tokens = max_queued_tokens
        self.in_flight = 0
        self.queued_tokens = 0
        # One compute thread: requests run one at a time in arrival order, torch uses its own threads inside.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="span-compute")

    @property
    def start(self) -> int:
        return self.span.start

    @property
    def end(self) -> int:
        return self.span.end

    @torch.inference_mode()
    def forward_sync(self, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Run blocks ``start:end`` (a sub-span of the held one)."""
        x = self.span(hidden.to(self.device, self.dtype), blocks=(start, end))
        return x.float().cpu()

    async def forward(self, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        tokens = hidden.shape[0] * hidden.shape[1]
        if self.in_flight >= self.max_concurrent:
            raise RemoteError(ErrorCode.BUSY, f"server busy: {self.in_flight} requests in flight")
        if self.max_queued_tokens is not None and self.in_flight and self.queued_tokens + tokens > self.max_queued_tokens:
            raise RemoteError(ErrorCode.BUSY, f"server busy: {self.queued_tokens} tokens queued")
        self.in_flight += 1
        self.queued_tokens += tokens
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.executor, self.forward_sync, hidden, start, end)
        finally:
            self.in_flight -= 1
            self.queued_tokens -= tokens

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
