"""The denoiser calls of one generation: which rows each call computes, and how many run at once.

Two of the latency-hiding mechanisms live here, the same for the local model and the swarm, so both give
the same tokens for every setting:

* the client half of the activation cache (:class:`CachePolicy`): a call either *fills* (the whole
  sequence, whose keys and values the model remembers) or *reuses* (only the active block's rows, or for
  ``prefix`` the block and everything after it). Logits of rows not recomputed are those of the last fill.
* concurrency for stale pipelining (:class:`DenoiserCalls`): calls are submitted and collected later, so
  several can be in flight; remote backends run them on worker threads.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from swarm.diffusion.config import GenerationConfig
from swarm.diffusion.sampler import DenoiseContext, Ready
from swarm.models.kv_cache import CacheMiss

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheDirective:
    """What one call computes: the whole sequence remembering keys and values (``rows`` None), or rows a:b."""

    rows: Optional[tuple[int, int]] = None

    @property
    def fill(self) -> bool:
        return self.rows is None

    def as_extra(self) -> dict[str, Any]:
        """The request metadata servers read (``extra["cache"]``)."""
        return {"cache": {"rows": None if self.rows is None else list(self.rows)}}


FILL = CacheDirective()

Forward = Callable[[torch.Tensor, Optional[CacheDirective], DenoiseContext], torch.Tensor]
"""A backend's pass: tokens (batch, length) -> logits (batch, rows, vocab) of the directive's rows (every row
when the directive is None or a fill). Raises :class:`CacheMiss` when a reuse finds no cache."""


class CachePolicy:
    """Decides fill or reuse for each call, and completes reused rows with the last fill's logits."""

    def __init__(self, mode: str, refresh: int, logits_shift: bool):
        self.mode, self.refresh = mode, refresh
        self.shift = 1 if logits_shift else 0  # Dream scores row i from hidden state i - 1: compute one more
        self.filled_for: Optional[tuple] = None
        self.since_fill = 0
        self.fill_logits: Optional[torch.Tensor] = None
        self.fills = self.reuses = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def directive(self, tokens: torch.Tensor, context: DenoiseContext) -> Optional[CacheDirective]:
        """Fill at every new block, batch shape or refresh period; otherwise reuse the active rows."""
        if not self.enabled:
            return None
        key = (context.block_start, tuple(tokens.shape))
        if key != self.filled_for or (self.refresh and self.since_fill + 1 >= self.refresh):  # a fill every N calls
            self.mark_filled(key)
            return FILL
        self.since_fill += 1
        self.reuses += 1
        end = context.block_end if self.mode == "dual" else tokens.shape[1]
        return CacheDirective((context.block_start - self.shift, end))

    def mark_filled(self, key: tuple) -> None:
        self.filled_for, self.since_fill = key, 0
        self.fills += 1

    def complete(self, directive: Optional[CacheDirective], output: torch.Tensor) -> torch.Tensor:
        """Logits for every row: a fill's own, or the last fill's with the recomputed rows replaced."""
        if directive is None:
            return output
        if directive.fill:
            self.fill_logits = output
            return output
        start, end = directive.rows
        merged = self.fill_logits.clone()
        merged[:, start + self.shift:end] = output[:, self.shift:]
        return merged


class PendingLogits:
    """One submitted call; :meth:`result` waits for it and completes it (once)."""

    def __init__(self, calls: "DenoiserCalls", tokens: torch.Tensor, context: DenoiseContext,
                 directive: Optional[CacheDirective], job: Union[Future, Ready]):
        self.calls, self.tokens, self.context, self.directive, self.job = calls, tokens, context, directive, job
        self._logits: Optional[torch.Tensor] = None

    @property
    def barrier(self) -> bool:
        """A fill: later calls rely on the cache it builds, so the sampler waits for it before going on."""
        return self.directive is not None and self.directive.fill

    def result(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = self.calls.collect(self)
        return self._logits

    def cancel(self) -> None:
        if isinstance(self.job, Future):
            self.job.cancel()


class DenoiserCalls:
    """The sampler's denoiser over a backend :data:`Forward`: cache policy, and ``workers`` threads for calls in
    flight (0 runs each call at once, in the caller's thread, as the local model does)."""

    def __init__(self, forward: Forward, generation: GenerationConfig, logits_shift: bool = False, workers: int = 0):
        self.forward = forward
        self.policy = CachePolicy(generation.cache, generation.cache_refresh, logits_shift)
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="denoiser") if workers else None
        self.misses = 0

    def __call__(self, tokens: torch.Tensor, context: DenoiseContext) -> torch.Tensor:
        return self.submit(tokens, context).result()

    def submit(self, tokens: torch.Tensor, context: DenoiseContext) -> PendingLogits:
        directive = self.policy.directive(tokens, context)
        if self.executor is None:
            try:
                job: Union[Future, Ready] = Ready(self.forward(tokens, directive, context))
            except CacheMiss as miss:  # raised again, and handled, when the result is collected
                job = _failed(miss)
        else:
            job = self.executor.submit(self.forward, tokens, directive, context)
        return PendingLogits(self, tokens, context, directive, job)

    def collect(self, pending: PendingLogits) -> torch.Tensor:
        try:
            output = pending.job.result()
        except CacheMiss as miss:
            output = self._refill(pending, miss)
            return self.policy.complete(FILL, output)
        return self.policy.complete(pending.directive, output)

    def _refill(self, pending: PendingLogits, miss: CacheMiss) -> torch.Tensor:
        """A server lost (or never had) the cache, e.g. after a failover: fill it again with this call's tokens.

        A second miss right after a refill means the cache cannot be kept (a server without room for it);
        the rest of the generation then runs uncached.
        """
        self.misses += 1
        if self.misses > 1 and self.policy.since_fill <= 1:
            logger.warning("activation cache missed again right after a refill (%s): continuing without it", miss)
            self.policy.mode = "none"
            return self.forward(pending.tokens, None, pending.context)
        logger.info("activation cache miss (%s): refilling", miss)
        self.policy.mark_filled((pending.context.block_start, tuple(pending.tokens.shape)))
        return self.forward(pending.tokens, FILL, pending.context)

    def close(self) -> None:
        """Drop calls not started; wait for running ones (at most one round trip), so none outlives the generation."""
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)


def _failed(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future
