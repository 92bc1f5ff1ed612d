"""One failover loop for every remote call: pick a peer, call it, on failure record it and try the next.

Span hops and expert queries differ only in how they pick a peer (the route from a block, or the next
server of a domain) and which errors no other peer can fix; the loop, its bounds (``max_retries``,
``retry_deadline``), its back-off and its bookkeeping are the same, so they live here once.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, TypeVar

from swarm.client.config import ClientConfig
from swarm.client.peers import PeerHealth
from swarm.utils.errors import SwarmError
from swarm.wire.messages import ErrorCode, RemoteError

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

# Errors that say the request itself is wrong: retrying elsewhere cannot help.
CLIENT_FAULTS = {ErrorCode.BAD_REQUEST, ErrorCode.TOO_LARGE, ErrorCode.NOT_FINITE, ErrorCode.HALTED}


MAX_ERRORS_SHOWN = 8  # distinct recent errors a give-up message lists


class RetriesExhausted(SwarmError, RuntimeError):
    """A remote call gave up after the configured retries or time (``except swarm.client.SwarmError`` catches
    it, as before it was given its own name)."""


@dataclass
class FailoverEvent:
    peer_id: str
    block: int  # -1 for an expert query
    error: str
    at: float = field(default_factory=time.time)


class RetryBudget:
    """The failures one logical call (a pass through every block, one expert query) may spend.

    Peers that failed during the call are never asked again within it, whatever their ban says.
    """

    def __init__(self, config: ClientConfig):
        self.config = config
        self.attempts = 0
        self.started = time.monotonic()
        self.delay = config.backoff_base
        self.errors: list[str] = []
        self.failed_peers: set[str] = set()

    def spend(self, error: str, pause: Optional[float] = None, where: str = "") -> None:
        """Count a failed attempt (``where``: " at block 3") and wait before the next; raise
        :class:`RetriesExhausted` when over budget."""
        self.attempts += 1
        self.wait(error, pause, where)

    def wait(self, error: str, pause: Optional[float] = None, where: str = "") -> None:
        """Wait before trying again (the back-off when ``pause`` is None) without counting a failed attempt: a
        busy server is worth waiting for, within ``retry_deadline``; raise :class:`RetriesExhausted` when over
        budget."""
        if error not in self.errors[-MAX_ERRORS_SHOWN:]:
            self.errors = (self.errors + [error])[-MAX_ERRORS_SHOWN:]
        if pause is None:
            pause, self.delay = self.delay, min(2 * self.delay, self.config.backoff_max)
        elapsed = time.monotonic() - self.started
        if self.attempts > self.config.max_retries or elapsed + pause > self.config.retry_deadline:
            raise RetriesExhausted(f"gave up{where} after {self.attempts} failed attempts in {elapsed:.1f} s: "
                             f"{'; '.join(self.errors)}")
        time.sleep(pause)


def call_with_failover(
    pick: Callable[[frozenset[str]], T],
    peer_of: Callable[[T], str],
    attempt: Callable[[T], R],
    *,
    health: PeerHealth,
    budget: RetryBudget,
    final: Callable[[RemoteError], Optional[BaseException]],
    on_failure: Callable[[T, RemoteError], None] = lambda target, error: None,
    label: Callable[[T], str] = lambda target: "",
) -> R:
    """``attempt(pick(avoid))`` until it succeeds.

    ``pick`` gets the peers that failed within this call and raises when no usable peer is left; ``final``
    maps an error no other peer can fix to the exception to raise (None: try another peer). Every other
    failure bans the peer (briefly when busy) and spends the budget; ``label`` names the target in messages.
    """
    while True:
        target = pick(frozenset(budget.failed_peers))
        peer = peer_of(target)
        try:
            return attempt(target)
        except RemoteError as error:
            error.peer_id = error.peer_id or peer
            fatal = final(error)
            if fatal is not None:
                raise fatal from None
            busy = error.code == ErrorCode.BUSY
            health.record_failure(peer, str(error), busy=busy, stalled=error.code == ErrorCode.TIMEOUT,
                                  retry_after=error.retry_after if busy else None)
            on_failure(target, error)
            where = label(target)
            message, at = f"{peer[-8:]}{'@' + where if where else ''}: {error.message}", f" at {where}" if where else ""
            if busy:  # a full server is worth waiting for, within the deadline
                budget.wait(message, where=at)
            else:  # one that failed is not asked again in this call
                budget.failed_peers.add(peer)
                budget.spend(message, where=at)
