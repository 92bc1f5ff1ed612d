"""The denoiser calls of one generation: which rows each call computes, and how many run at once.

Two of the latency-hiding mechanisms live here, the same for the local model and the swarm, so both give
the same tokens for every setting:

* the client half of the activation cache (:class:`CachePolicy`): a call either *fills* (the whole
  sequence, whose keys and values the model remembers as a new numbered version) or *reuses* one version
  (only the active block's rows, or for ``prefix`` the block and everything after it). Logits of rows not
  recomputed are those of the fill it reuses. Naming the version lets calls run concurrently across a
  fill: a server answers a reuse from its own version (waiting for that fill if it has not arrived).
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
    """What one call computes: the whole sequence, remembered as cache ``version`` (``rows`` None), or rows
    a:b against that version. ``keep_from`` (fills only): older versions of the session may be dropped."""

    version: int
    rows: Optional[tuple[int, int]] = None
    keep_from: int = 0

    @property
    def fill(self) -> bool:
        return self.rows is None

    def as_extra(self) -> dict[str, Any]:
        """The request metadata servers read (``extra["cache"]``)."""
        rows = None if self.rows is None else list(self.rows)
        return {"cache": {"rows": rows, "version": self.version, "keep_from": self.keep_from}}


Forward = Callable[[torch.Tensor, Optional[CacheDirective], DenoiseContext], torch.Tensor]
"""A backend's pass: tokens (batch, length) -> logits (batch, rows, vocab) of the directive's rows (every row
when the directive is None or a fill). Raises :class:`CacheMiss` when a reuse finds no cache."""


class CachePolicy:
    """Decides fill or reuse for each call."""

    def __init__(self, mode: str, refresh: int, logits_shift: bool):
        self.mode, self.refresh = mode, refresh
        self.shift = 1 if logits_shift else 0  # Dream scores row i from hidden state i - 1: compute one more
        self.filled_for: Optional[tuple] = None
        self.since_fill = 0
        self.fills = self.reuses = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def version(self) -> int:
        """The newest fill's version (fills are numbered 1, 2, ...)."""
        return self.fills

    def directive(self, tokens: torch.Tensor, context: DenoiseContext, keep_from: int) -> Optional[CacheDirective]:
        """Fill at every new block, batch shape or refresh period; otherwise reuse the active rows."""
        if not self.enabled:
            return None
        key = (context.block_start, tuple(tokens.shape))
        if key != self.filled_for or (self.refresh and self.since_fill + 1 >= self.refresh):  # a fill every N calls
            return self.new_fill(key, keep_from)
        self.since_fill += 1
        self.reuses += 1
        end = context.block_end if self.mode == "dual" else tokens.shape[1]
        return CacheDirective(self.version, (context.block_start - self.shift, end))

    def new_fill(self, key: tuple, keep_from: int) -> CacheDirective:
        self.filled_for, self.since_fill = key, 0
        self.fills += 1
        return CacheDirective(self.version, keep_from=min(keep_from, self.version))

    def forget_fill(self) -> None:
        """A fill was dropped before its logits were used (a stale guess overturned): the next call fills."""
        self.filled_for = None

    def complete(self, directive: Optional[CacheDirective], output: torch.Tensor,
                 fill_logits: Optional[torch.Tensor]) -> torch.Tensor:
        """Logits for every row: a fill's own, or ``fill_logits`` (the reused fill's) with recomputed rows replaced."""
        if directive is None or directive.fill:
            return output
        start, end = directive.rows
        merged = fill_logits.clone()
        merged[:, start + self.shift:end] = output[:, self.shift:]
        return merged


class PendingLogits:
    """One submitted call; :meth:`result` waits for it and completes it (once)."""

    def __init__(self, calls: "DenoiserCalls", tokens: torch.Tensor, context: DenoiseContext,
                 directive: Optional[CacheDirective], job: Union[Future, Ready]):
        self.calls, self.tokens, self.context, self.directive, self.job = calls, tokens, context, directive, job
        self.fill = calls.last_fill if directive is not None and not directive.fill else None  # the one it reuses
        self._logits: Optional[torch.Tensor] = None

    def result(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = self.calls.collect(self)
        return self._logits

    def cancel(self) -> None:
        """Not needed any more: drop the call if it has not started (a running one still finishes)."""
        self.calls.live.discard(self)
        if self.directive is not None and self.directive.fill and self._logits is None:
            self.calls.policy.forget_fill()  # its state was a wrong guess: later reuses must not rely on it
        if isinstance(self.job, Future):
            self.job.cancel()


class DenoiserCalls:
    """The sampler's denoiser over a backend :data:`Forward`: cache policy, and ``workers`` threads for calls in
    flight (0 runs each call at once, in the caller's thread, as the local model does)."""

    def __init__(self, forward: Forward, generation: GenerationConfig, logits_shift: bool = False, workers: int = 0):
        self.forward = forward
        self.policy = CachePolicy(generation.cache, generation.cache_refresh, logits_shift)
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="denoiser") if workers else None
        self.last_fill: Optional[PendingLogits] = None
        self.live: set[PendingLogits] = set()  # submitted, neither collected nor dropped
        self.misses = 0

    def __call__(self, tokens: torch.Tensor, context: DenoiseContext) -> torch.Tensor:
        return self.submit(tokens, context).result()

    def submit(self, tokens: torch.Tensor, context: DenoiseContext) -> PendingLogits:
        directive = self.policy.directive(tokens, context, self.oldest_version_in_use())
        pending = PendingLogits(self, tokens, context, directive, self._start(tokens, directive, context))
        if directive is not None and directive.fill:
            self.last_fill = pending
        self.live.add(pending)
        return pending

    def oldest_version_in_use(self) -> int:
        """Cache versions older than this are read by no call still to be collected (servers may drop them)."""
        versions = [p.directive.version for p in self.live if p.directive is not None]
        return min(versions, default=self.policy.version + 1)

    def _start(self, tokens: torch.Tensor, directive: Optional[CacheDirective], context: DenoiseContext):
        if self.executor is not None:
            return self.executor.submit(self.forward, tokens, directive, context)
        try:
            return Ready(self.forward(tokens, directive, context))
        except CacheMiss as miss:  # raised again, and handled, when the result is collected
            return _failed(miss)

    def collect(self, pending: PendingLogits) -> torch.Tensor:
        self.live.discard(pending)
        try:
            output = pending.job.result()
        except CacheMiss as miss:
            return self._recover(pending, miss)
        fill_logits = pending.fill.result() if pending.fill is not None else None
        return self.policy.complete(pending.directive, output, fill_logits)

    def _recover(self, pending: PendingLogits, miss: CacheMiss) -> torch.Tensor:
        """A server lost (or never had) the cache, e.g. after a failover: fill it again with this call's tokens.

        A reuse of a version older than a refill of the same block made since reads that refill. A fill that
        misses (a server keeping no cache), or a second miss right after a refill (a server without room for
        it), makes the rest of the generation run uncached.
        """
        latest = self.last_fill
        if (not pending.directive.fill and latest is not None and latest is not pending.fill
                and latest.context.block_start == pending.context.block_start
                and not (isinstance(latest.job, Future) and latest.job.cancelled())):
            retry = CacheDirective(latest.directive.version, pending.directive.rows)
            return self.policy.complete(retry, self.forward(pending.tokens, retry, pending.context), latest.result())
        self.misses += 1
        if pending.directive.fill or (self.misses > 1 and self.policy.since_fill <= 1):
            logger.warning("activation cache missed (%s) where it cannot be rebuilt: continuing without it", miss)
            self.policy.mode = "none"
            return self.forward(pending.tokens, None, pending.context)
        logger.info("activation cache miss (%s): refilling", miss)
        key = (pending.context.block_start, tuple(pending.tokens.shape))
        fill = self.policy.new_fill(key, keep_from=self.policy.version + 1)
        refill = PendingLogits(self, pending.tokens, pending.context, fill,
                               Ready(self.forward(pending.tokens, fill, pending.context)))
        self.last_fill = refill
        return refill.result()

    def close(self) -> None:
        """Drop calls not started; wait for running ones (at most one round trip), so none outlives the generation."""
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)


def _failed(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future
