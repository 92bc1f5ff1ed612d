"""Watching the governance records: servers poll in the background, clients check before each step."""
from __future__ import annotations

import logging
import time
from typing import Iterable, Optional

from hivemind.dht import DHT

from swarm.diffusion.sampler import Halted
from swarm.governance.keys import parse_public_key, trusted_key_texts
from swarm.governance.records import Decision, GovernanceState, check_stale_after

logger = logging.getLogger(__name__)


class SwarmHalted(Halted):
    """The swarm's governance halted generation; carries the decision and the step it stopped before."""

    def __init__(self, decision: Decision, step: int):
        self.decision = decision
        super().__init__(step, decision.reason or "no reason given",
                         {"signer": decision.signer, "signed_at": decision.timestamp, "sequence": decision.sequence})


class GovernanceUnreadable(Halted):
    """Fail-safe stop: no valid governance decision was read for longer than the bound (the records may be
    flooded or the DHT unreachable), so a halt could be standing unseen."""

    def __init__(self, step: int, reason: str):
        super().__init__(step, reason, {"unreadable": True})


class GovernanceGuard:
    """The newest valid decision for a prefix, re-read from the DHT at most every ``ttl`` seconds.

    With no trusted keys configured (none given and ``$SWARM_GOVERNANCE_KEYS`` empty) it is disabled and
    never reads the DHT. With keys and ``stale_after`` > 0 it fails safe: when no read returned a valid decision
    by a trusted key (a halt or a resume) for ``stale_after`` seconds (counted from start until the first),
    :meth:`unreadable` says why and :meth:`check` stops, as for a halt. Operators therefore publish a ``resume``
    once when they set up their keys.
    """

    def __init__(self, dht: DHT, prefix: str, keys: Iterable[str] = (), ttl: float = 0.5,
                 stale_after: float = 0.0):
        self.state = GovernanceState(prefix, [parse_public_key(k) for k in trusted_key_texts(keys)])
        self.dht, self.ttl = dht, ttl
        self.stale_after = check_stale_after(stale_after)
        self._checked_at = float("-inf")
        self._started = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self.state.enabled

    def current(self, force: bool = False) -> Optional[Decision]:
        if not self.enabled:
            return None
        if force or time.monotonic() - self._checked_at >= self.ttl:
            try:
                self.state.refresh(self.dht)
            except Exception as error:  # an unreachable DHT must not stop or crash generation by itself
                logger.warning("could not read governance records: %r", error)
            self._checked_at = time.monotonic()
        return self.state.current

    def unreadable(self) -> Optional[str]:
        """Why the governance state counts as unreadable now (the fail-safe bound passed), or None."""
        if not self.enabled or self.stale_after <= 0:
            return None
        seen = self.state.seen_at
        unseen = time.monotonic() - (self._started if seen is None else seen)
        if unseen <= self.stale_after:
            return None
        hint = "" if seen else "; none ever: operators publish a resume once (python -m swarm.governance resume)"
        return (f"governance state unreadable: no valid decision by a trusted key read for {unseen:.0f} s (bound "
                f"{self.stale_after:.0f} s; records flooded or the DHT unreachable?){hint}")

    def check(self, step: int) -> None:
        """Raise :class:`SwarmHalted` if a valid halt stands, :class:`GovernanceUnreadable` if the state could not be
        read for longer than the bound."""
        decision = self.current()
        if decision is not None and decision.halted:
            raise SwarmHalted(decision, step)
        reason = self.unreadable()
        if reason is not None:
            raise GovernanceUnreadable(step, reason)
