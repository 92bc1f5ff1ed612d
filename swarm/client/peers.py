"""What this client has learned about each server, owned in one place.

The route, the expert queries and the spot checks all ask the same questions (may I use this peer? how
long should I wait for it?) and report the same events (it answered in so many seconds, it failed, it
lied). Keeping the answers here means a server that fails as an expert is also avoided as a hop, and a
server caught lying is never used for anything again.

Bans double on every repeat, and a ban for a stalled call outlasts two request timeouts, so a peer that
does not answer is never retried within the call it stalled; a peer that could not be dialled and then
announces new addresses is tried again at once. Timeouts adapt to what each peer has shown: a peer
that answered its compute challenge in 20 ms is not given the full request timeout for the next call.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Optional

if TYPE_CHECKING:
    from swarm.client.config import ClientConfig

logger = logging.getLogger(__name__)

EWMA_WEIGHT = 0.3  # weight of the newest observation in a peer's running speed estimate


@dataclass
class Ban:
    until: float
    count: int
    busy: bool  # a full server: avoided briefly, and worth waiting for when nothing else covers its blocks
    stalled: bool = False  # it let a call run into its timeout (a tarpit, or a hung server)


class PeerHealth:
    """Bans with back-off, round trips and speeds, distrust and the allow-list of one client; thread-safe."""

    def __init__(self, config: "ClientConfig"):
        self.config = config
        self._bans: dict[str, Ban] = {}
        self._rtt: dict[str, float] = {}
        # (peer, kind of call) -> seconds one unit of work (tokens x blocks) took there beyond the round trip
        self._speed: dict[tuple[str, str], float] = {}
        self._distrusted: dict[str, str] = {}  # peer -> why; never used again by this client
        self._disputes: dict[str, int] = {}  # unresolved spot checks against each peer
        self._audit_failed: dict[str, str] = {}  # peer -> why its latest check by a trusted auditor failed
        self.allowed: Optional[frozenset[str]] = None  # when set, only these peers may serve (restricted tier)
        self._queued: dict[str, int] = {}  # work this client has sent each peer and not had answered yet
        self._lock = threading.Lock()

    # ----- what happened -----------------------------------------------------------------------------
    def record_ping(self, peer: str, rtt: float) -> None:
        with self._lock:
            self._rtt[peer] = rtt

    def record_success(self, peer: str, seconds: float, work: int, kind: str = "span") -> None:
        """A call of ``work`` units (tokens x blocks) answered in ``seconds``: refines the peer's speed."""
        observed = max(seconds - self._rtt.get(peer, 0.0), 0.0) / max(work, 1)
        with self._lock:
            previous = self._speed.get((peer, kind), observed)
            self._speed[(peer, kind)] = (1 - EWMA_WEIGHT) * previous + EWMA_WEIGHT * observed

    def record_failure(self, peer: str, reason: str, busy: bool = False, stalled: bool = False,
                       retry_after: Optional[float] = None) -> float:
        """Avoid a peer: briefly when busy (at least its ``retry_after`` hint, at most ``ban_max``), otherwise for
        a period that doubles on each repeat. A peer that ``stalled`` a call into its timeout is avoided for at
        least two request timeouts, so it cannot stall the next call too. Returns the ban's length in seconds."""
        with self._lock:
            previous = self._bans.get(peer)
            count = previous.count + 1 if previous else 1
            if busy:
                duration = min(self.config.backoff_base * 2 ** (count - 1), self.config.backoff_max)
                duration = max(duration, min(retry_after or 0.0, self.config.ban_max))
            else:
                duration = min(self.config.ban_base * 2 ** (count - 1), self.config.ban_max)
                if stalled:
                    duration = max(duration, 2 * self.config.request_timeout)
            self._bans[peer] = Ban(time.monotonic() + duration, count, busy, stalled)
            if not busy:  # measured again (challenge included) before it is routed to again
                self._rtt.pop(peer, None)
        logger.warning("avoiding peer %s for %.1f s: %s", peer, duration, reason)
        return duration

    def forgive(self, peer: str, reason: str) -> None:
        """Lift a ban that no longer applies (an unreachable server announced new addresses); the peer is
        challenged again before any route uses it. Distrust, disputes and stalls are never forgiven."""
        with self._lock:
            ban = self._bans.get(peer)
            if ban is None or ban.stalled or peer in self._distrusted:
                return
            del self._bans[peer]
        logger.info("trying peer %s again: %s", peer, reason)

    def distrust(self, peer: str, reason: str) -> None:
        """Caught returning wrong results: never used again by this client."""
        with self._lock:
            self._distrusted[peer] = reason
        logger.error("not using peer %s again: %s", peer, reason)

    def dispute(self, peer: str, reason: str) -> None:
        """One side of an unresolved spot check (two servers disagreed, nobody could tell who lied): avoided for
        the rest of the session, like the other side, so that neither can get the other avoided and take its
        place; unlike distrust it is no verdict, and it says so in the log."""
        with self._lock:
            self._disputes[peer] = self._disputes.get(peer, 0) + 1
        logger.warning("avoiding peer %s for the rest of the session: %s", peer, reason)

    def audit_failures(self, failed: dict[str, str]) -> None:
        """Avoid exactly the peers whose latest check by a trusted auditor failed (``swarm.reports.records``), with why;
        replaced on each read of the reports, so a server that passes a later check is used again."""
        with self._lock:
            new = {peer: reason for peer, reason in failed.items() if peer not in self._audit_failed}
            self._audit_failed = dict(failed)
        for peer, reason in new.items():
            logger.warning("avoiding peer %s while its latest trusted audit says it failed: %s", peer, reason)

    def allow_only(self, peers: Optional[frozenset[str]]) -> bool:
        """Restrict (or, with None, stop restricting) which peers may serve; True when the set changed."""
        changed = peers != self.allowed
        self.allowed = peers
        return changed

    @contextlib.contextmanager
    def calling(self, peer: str, work: int) -> Iterator[None]:
        """A call of ``work`` units to ``peer`` is on its way: calls sent to it meanwhile wait behind it there (the
        passes of a pipelined generation, a pushed pass's later hops), and :meth:`timeout` gives them its time."""
        with self._lock:
            self._queued[peer] = self._queued.get(peer, 0) + work
        try:
            yield
        finally:
            with self._lock:
                left = self._queued.pop(peer, 0) - work
                if left > 0:
                    self._queued[peer] = left

    # ----- questions -------------------------------------------------------------------------------
    def usable(self, peer: str) -> bool:
        return peer not in self.excluded((peer,))

    def excluded(self, peers: Iterable[str] = ()) -> frozenset[str]:
        """Peers that may not be used now: banned, distrusted, disputed, failed by a trusted auditor, or (among
        ``peers``) not on the allow-list."""
        now = time.monotonic()
        with self._lock:
            out = ({peer for peer, ban in self._bans.items() if ban.until > now} | set(self._distrusted)
                   | set(self._disputes) | set(self._audit_failed))
        if self.allowed is not None:
            out |= {peer for peer in peers if peer not in self.allowed}
        return frozenset(out)

    def maybe_live(self, peer: str) -> bool:
        """Whether nothing says the peer is gone: it never failed a call of this client, or it answered a ping since
        (a dead replica's record outlives it; a replica this client never called is not suspect)."""
        with self._lock:
            return peer in self._rtt or peer not in self._bans

    def measured(self, peer: str) -> bool:
        """Whether the peer passed a ping (and its challenge) since it was last banned."""
        return peer in self._rtt

    def latencies(self) -> dict[str, float]:
        with self._lock:
            return dict(self._rtt)

    def timeout(self, peer: str, work: int, kind: str = "span") -> float:
        """How long to wait for a call of ``work`` units (rows x blocks, every state's rows counted): the link's
        round trip and the peer's measured speed over this work and the work this client's own calls still have
        queued there (they are answered first), times ``timeout_factor``, plus ``timeout_floor``. Capped by
        ``request_timeout`` unless this client's own queue there is what makes it longer: a live server that is
        busy with this client's earlier calls is not timed out for them. A peer not measured for this kind of
        call yet gets the full request timeout (span servers are measured by the challenge before their first
        call)."""
        with self._lock:
            speed, ahead = self._speed.get((peer, kind)), self._queued.get(peer, 0)
            rtt = self._rtt.get(peer, 0.0)
        if speed is None:
            return self.config.request_timeout
        own = self.config.timeout_floor + self.config.timeout_factor * (rtt + speed * work)
        queued = self.config.timeout_factor * speed * ahead
        return min(self.config.request_timeout, own) + queued

    def wait_for_busy(self) -> Optional[float]:
        """Seconds until the first busy peer may be tried again (0 when its short ban has just run out), or
        None when no peer was busy lately."""
        now = time.monotonic()
        recent = now - self.config.backoff_max
        with self._lock:
            waits = [max(ban.until - now, 0.0) for ban in self._bans.values() if ban.busy and ban.until > recent]
        return min(waits) if waits else None

    @property
    def distrusted(self) -> frozenset[str]:
        return frozenset(self._distrusted)

    def disputes(self) -> dict[str, int]:
        return dict(self._disputes)

    @property
    def audit_failed(self) -> dict[str, str]:
        with self._lock:
            return dict(self._audit_failed)
