"""Watching the governance records: servers poll in the background, clients check before each step."""
from __future__ import annotations

import logging
import time
from typing import Iterable, Optional

from hivemind.dht import DHT

from swarm.diffusion.sampler import Halted
from swarm.governance.keys import parse_public_key, public_keys_from_env
from swarm.governance.records import Decision, GovernanceState

logger = logging.getLogger(__name__)


class SwarmHalted(Halted):
    """The swarm's governance halted generation; carries the decision and the step it stopped before."""

    def __init__(self, decision: Decision, step: int):
        self.decision = decision
        super().__init__(step, decision.reason or "no reason given",
                         {"signer": decision.signer, "signed_at": decision.timestamp, "sequence": decision.sequence})


class GovernanceGuard:
    """The newest valid decision for a prefix, re-read from the DHT at most every ``ttl`` seconds.

    With no trusted keys configured (none given and ``$SWARM_GOVERNANCE_KEYS`` empty) it is disabled and
    never reads the DHT.
    """

    def __init__(self, dht: DHT, prefix: str, keys: Iterable[str] = (), ttl: float = 0.5):
        texts = list(keys) or public_keys_from_env()
        self.state = GovernanceState(prefix, [parse_public_key(k) for k in texts])
        self.dht, self.ttl = dht, ttl
        self._checked_at = float("-inf")

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

    def check(self, step: int) -> None:
        """Raise :class:`SwarmHalted` if a valid halt stands."""
        decision = self.current()
        if decision is not None and decision.halted:
            raise SwarmHalted(decision, step)
