"""The compute side of a server: a loaded span, run on a worker thread, with bounded concurrency."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, TypeVar

import torch

from swarm.models.kv_cache import SpanKV
from swarm.models.modules import BlockSpan
from swarm.protocol import ErrorCode, RemoteError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ComputeQueue:
    """One compute thread with admission control: work beyond the request or token bounds is refused as busy.

    Requests run one at a time in arrival order (torch uses its own threads inside each), so a bound on
    what may wait is what keeps a server's memory and latency in check.
    """

    def __init__(self, max_concurrent: int, max_queued_tokens: Optional[int] = None, name: str = "compute"):
        self.max_concurrent = max_concurrent
        self.max_queued_tokens = max_queued_tokens
        self.in_flight = 0
        self.queued_tokens = 0
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, tokens: int, fn: Callable[..., T], *args) -> T:
        if self.in_flight >= self.max_concurrent:
            raise RemoteError(ErrorCode.BUSY, f"server busy: {self.in_flight} requests in flight")
        if self.max_queued_tokens is not None and self.in_flight and self.queued_tokens + tokens > self.max_queued_tokens:
            raise RemoteError(ErrorCode.BUSY, f"server busy: {self.queued_tokens} tokens queued")
        self.in_flight += 1
        self.queued_tokens += tokens
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        finally:
            self.in_flight -= 1
            self.queued_tokens -= tokens

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


class SpanBackend:
    """Runs forward passes of one span; refuses work beyond its bounds instead of queueing forever."""

    def __init__(self, span: BlockSpan, max_concurrent: int, device: str = "cpu",
                 max_queued_tokens: Optional[int] = None):
        self.span = span
        self.device = torch.device(device)
        self.dtype = next(span.parameters()).dtype
        self.queue = ComputeQueue(max_concurrent, max_queued_tokens, "span-compute")

    @property
    def in_flight(self) -> int:
        return self.queue.in_flight

    @property
    def queued_tokens(self) -> int:
        return self.queue.queued_tokens

    @property
    def start(self) -> int:
        return self.span.start

    @property
    def end(self) -> int:
        return self.span.end

    @torch.inference_mode()
    def forward_sync(self, hidden: torch.Tensor, start: int, end: int, kv: Optional[SpanKV] = None,
                     rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """Run blocks ``start:end`` (a sub-span of the held one), filling or reusing ``kv`` (see BlockSpan)."""
        x = self.span(hidden.to(self.device, self.dtype), blocks=(start, end), kv=kv, rows=rows)
        return x.float().cpu()

    async def forward(self, hidden: torch.Tensor, start: int, end: int, kv: Optional[SpanKV] = None,
                      rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
        return await self.queue.run(hidden.shape[0] * hidden.shape[1], self.forward_sync, hidden, start, end, kv, rows)

    def shutdown(self) -> None:
        self.queue.shutdown()
