"""The denoiser calls of one generation: which rows each call computes, and how many run at once.

Two of the latency-hiding mechanisms live here, the same for the local model and the swarm, so both give
the same tokens for every setting:

* the client half of the activation cache (:class:`CachePolicy`): a call either *fills* (the whole
  sequence, whose keys and values the model remembers as a new numbered version) or *reuses* one version
  (only the active block's rows, or for ``prefix`` the block and everything after it). Logits of rows not
  recomputed are those of the fill it reuses. Naming the version lets calls run concurrently across a
  fill: a server answers a reuse from its own version (waiting for that fill if it has not arrived).
  A reuse that finds its version gone (a failover moved the hop to a replica) has that version rebuilt
  from the tokens it was first filled with, so a failover keeps the tokens (:meth:`DenoiserCalls._recover`).
* concurrency for stale pipelining (:class:`DenoiserCalls`): calls are submitted and collected later, so
  several can be in flight; remote backends run them on worker threads.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from swarm.diffusion.config import HEAD_ROWS, GenerationConfig
from swarm.diffusion.denoiser import DenoiseContext, Pending, PipelinedDenoiser
from swarm.diffusion.prediction import Predictions
from swarm.models.kv_cache import CacheMiss

logger = logging.getLogger(__name__)

REBUILD_ATTEMPTS = 2  # a version rebuilt this often in a row and still missing: the servers cannot keep it


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

    def to_dict(self) -> dict[str, Any]:
        """The request metadata servers read (``extra["cache"]``)."""
        rows = None if self.rows is None else list(self.rows)
        return {"rows": rows, "version": self.version, "keep_from": self.keep_from}


Forward = Callable[[torch.Tensor, Optional[CacheDirective], DenoiseContext], torch.Tensor]
"""A backend's pass: tokens (batch, length) -> logits (batch, rows, vocab) of the directive's rows (every row
when the directive is None or a fill). Raises :class:`CacheMiss` when a reuse finds no cache. A backend may
compute the head only for the rows :func:`scored_rows` names (the others are then NaN): no reader of a
call's logits (sampler, guidance, expert composition, correctors, cache completion) reads any other row."""



def check_head_rows(head_rows: str) -> str:
    """A backend's ``head_rows`` setting, or a ValueError naming the choices."""
    if head_rows not in HEAD_ROWS:
        raise ValueError(f"head_rows must be one of {HEAD_ROWS}, got {head_rows!r}")
    return head_rows


def rows_to_score(head_rows: str, context: DenoiseContext, generation: GenerationConfig,
                  length: int) -> Optional[tuple[int, int]]:
    """What a backend's head computes for one call: :func:`scored_rows` with ``"active"``, every row (None)
    with ``"all"``."""
    return scored_rows(context, generation, length) if head_rows == "active" else None


def scored_rows(context: DenoiseContext, generation: GenerationConfig, length: int) -> tuple[int, int]:
    """Absolute positions whose logits the sampler may read from a call made with ``context``.

    One state, read at once: its active block. A Picard window's later states, and a stale-pipelined step
    deciding on an older state's logits, may already be in a later block (blocks fill left to right, never
    back): then everything from the active block on. Classifier-free guidance's unconditional rows, expert
    composition and correctors read the same block; Dream's one-row shift is the head's business.
    """
    if len(context.steps) > 1 or generation.staleness > 0:
        return context.block_start, length
    return context.block_start, context.block_end


class CachePolicy:
    """Decides fill or reuse for each call: at each new block, every ``refresh`` calls, and (``drift`` set) after a
    reuse whose predictions moved past ``drift`` from its fill's (:meth:`DenoiserCalls.observe`)."""

    def __init__(self, mode: str, refresh: int, logits_shift: bool, drift: Optional[float] = None):
        self.mode, self.refresh, self.drift = mode, refresh, drift
        self.shift = 1 if logits_shift else 0  # Dream scores row i from hidden state i - 1: compute one more
        self.filled_for: Optional[tuple] = None
        self.since_fill = 0
        self.fills = self.reuses = 0
        self.drifted = False  # the newest fill's reuses drifted past the bound: the next call fills
        self.drift_fills = 0  # fills made because of that

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
        if self.drifted:
            self.drift_fills += 1
            return self.new_fill(key, keep_from)
        self.since_fill += 1
        self.reuses += 1
        end = context.block_end if self.mode == "dual" else tokens.shape[1]
        return CacheDirective(self.version, (context.block_start - self.shift, end))

    def new_fill(self, key: tuple, keep_from: int) -> CacheDirective:
        self.filled_for, self.since_fill, self.drifted = key, 0, False
        self.fills += 1
        return CacheDirective(self.version, keep_from=min(keep_from, self.version))

    def forget_fill(self) -> None:
        """A fill was dropped before its logits were used (a stale guess overturned): the next call fills."""
        self.filled_for = None

    def complete(self, directive: Optional[CacheDirective], output: torch.Tensor,
                 fill_logits: Optional[torch.Tensor]) -> torch.Tensor:
        """Logits for every row: a fill's own, or ``fill_logits`` (the reused fill's) with recomputed rows replaced.
        A head server's predictions are whole already (it is asked only when the recomputed rows cover what the
        step reads)."""
        if directive is None or directive.fill or isinstance(output, Predictions):
            return output
        start, end = directive.rows
        merged = fill_logits.clone()
        merged[:, start + self.shift:end] = output[:, self.shift:]
        return merged


class PendingLogits(Pending):
    """One submitted call; :meth:`result` waits for it and completes it (once)."""

    def __init__(self, calls: "DenoiserCalls", tokens: torch.Tensor, context: DenoiseContext,
                 directive: Optional[CacheDirective], job: Future):
        self.calls, self.tokens, self.context, self.directive, self.job = calls, tokens, context, directive, job
        self.fill = calls.last_fill if directive is not None and not directive.fill else None  # the one it reuses
        self.sent_at = calls.rebuilds  # rebuilds made before this call was sent
        self.rebuilt_at = 0  # (a fill) the value of ``calls.rebuilds`` after its latest rebuild; 0: never rebuilt
        self.margins: Optional[torch.Tensor] = None  # (a fill, with a drift bound) its active block's top-two margins
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
        self.job.cancel()


class DenoiserCalls(PipelinedDenoiser):
    """The sampler's denoiser over a backend :data:`Forward`: cache policy, and ``workers`` threads for calls in
    flight (0 runs each call at once, in the caller's thread, as the local model does)."""

    def __init__(self, forward: Forward, generation: GenerationConfig, logits_shift: bool = False, workers: int = 0):
        self.forward = forward
        self.policy = CachePolicy(generation.cache, generation.cache_refresh, logits_shift,
                                  generation.cache_refresh_drift)
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="denoiser") if workers else None
        self.last_fill: Optional[PendingLogits] = None
        self.live: set[PendingLogits] = set()  # submitted, neither collected nor dropped
        self.misses = 0  # calls that found no cache
        self.rebuilds = 0  # fills sent again, with their first tokens, to repair a lost version

    def submit(self, tokens: torch.Tensor, context: DenoiseContext) -> PendingLogits:
        directive = self.policy.directive(tokens, context, self.oldest_version_in_use())
        pending = PendingLogits(self, tokens, context, directive, self._start(tokens, directive, context))
        if directive is not None and directive.fill:
            self.last_fill = pending
        self.live.add(pending)
        return pending

    def observe(self, pending: Pending, margins: torch.Tensor, masked: torch.Tensor) -> None:
        """The adaptive refresh: a fill's active-block margins (top-two probability gap per position, the sampler's
        prediction column, so the same numbers from local logits and a head server's predictions) are kept; a
        reuse of the newest fill whose margin at a still-masked position moved more than the bound makes the next
        call fill. Positions decided since the fill changed the context that the cached rows saw; how far the
        block's own predictions moved is the measure of it (Elastic-Cache refreshes on drift, too)."""
        directive = getattr(pending, "directive", None)
        if self.policy.drift is None or directive is None:
            return
        if directive.fill:
            pending.margins = margins
            return
        reference = pending.fill.margins if pending.fill is self.last_fill else None
        if reference is None or reference.shape != margins.shape or not masked.any():
            return
        if float((margins - reference).abs()[masked].max()) > self.policy.drift:
            self.policy.drifted = True

    def oldest_version_in_use(self) -> int:
        """Cache versions older than this are read by no call still to be collected (servers may drop them)."""
        versions = [p.directive.version for p in self.live if p.directive is not None]
        return min(versions, default=self.policy.version + 1)

    def _start(self, tokens: torch.Tensor, directive: Optional[CacheDirective], context: DenoiseContext) -> Future:
        if self.executor is not None:
            return self.executor.submit(self.forward, tokens, directive, context)
        done: Future = Future()
        try:
            done.set_result(self.forward(tokens, directive, context))
        except CacheMiss as miss:  # raised again, and handled, when the result is collected
            done.set_exception(miss)
        return done

    def collect(self, pending: PendingLogits) -> torch.Tensor:
        self.live.discard(pending)
        try:
            output = pending.job.result()
        except CacheMiss as miss:
            return self._recover(pending, miss)
        fill_logits = pending.fill.result() if pending.fill is not None else None
        return self.policy.complete(pending.directive, output, fill_logits)

    def _recover(self, pending: PendingLogits, miss: CacheMiss) -> torch.Tensor:
        """A server lost (or never had) the version a reuse reads, e.g. after a failover to a replica.

        The trajectory depends on which states the fills were computed on, so refilling from the current
        state would change the tokens. Instead the version's fill is sent again (same number, same tokens:
        each reuse holds its fill, so the client keeps the tokens of every version in use) and the reuse is
        repeated: the new server's cache then equals the lost one. A call sent before such a rebuild first
        simply tries again. A fill that misses (a server keeping no cache), or a version still missing after
        :data:`REBUILD_ATTEMPTS` rebuilds (a server without room for it), makes the rest run uncached.
        """
        self.misses += 1
        fill = pending.fill
        if pending.directive.fill or fill is None or not self.policy.enabled:
            return self._uncached(pending, miss)
        for attempt in range(REBUILD_ATTEMPTS):
            try:
                if attempt or fill.rebuilt_at <= pending.sent_at:  # not rebuilt since this call was sent
                    self._rebuild(fill, miss)
                output = self.forward(pending.tokens, pending.directive, pending.context)
            except CacheMiss as again:
                miss = again
                continue
            return self.policy.complete(pending.directive, output, fill.result())
        return self._uncached(pending, miss)

    def _rebuild(self, fill: PendingLogits, miss: CacheMiss) -> None:
        """Send ``fill`` again with its own tokens and version, keeping the versions calls in flight read."""
        version = fill.directive.version
        logger.info("activation cache miss (%s): rebuilding version %d from its own tokens", miss, version)
        directive = CacheDirective(version, keep_from=min(self.oldest_version_in_use(), version))
        output = self.forward(fill.tokens, directive, fill.context)
        self.rebuilds += 1
        fill.rebuilt_at = self.rebuilds
        if fill._logits is None and fill.job.cancelled():
            fill._logits = output  # its first pass never ran: this one stands for it

    def _uncached(self, pending: PendingLogits, miss: CacheMiss) -> torch.Tensor:
        """This call, and every later one, without the cache (exact logits, so tokens may differ)."""
        if self.policy.enabled:
            logger.warning("activation cache cannot be rebuilt (%s): the rest of the generation runs without it",
                           miss)
            self.policy.mode = "none"
        return self.forward(pending.tokens, None, pending.context)

    def close(self) -> None:
        """Drop calls not started; wait for running ones (at most one round trip), so none outlives the generation."""
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
