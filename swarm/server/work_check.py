"""The server's side of work stamps (:mod:`swarm.wire.work`): each checked in one hash and credited once.

A stamp is credited ``2**bits / price`` units of cost when it names this server and its caller, its epoch is this
server's or next to it, it proves at least :data:`~swarm.wire.work.MIN_BITS`, and it was not credited before. A
stamp that fails any of these is counted and credited nothing; the request is served all the same (a stamp buys a
place in the order, never admission). Credited stamps are remembered until their epoch is two behind, at most
``max_spent`` of them: past that, new stamps are credited nothing until old ones age out (what the bound cannot
remember it refuses, rather than forget a stamp that could then be spent again). Filling it takes
``max_spent x 2**MIN_BITS`` hashes every two epochs (docs/GOVERNANCE.md).
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

from swarm.dht.stamp import leading_zero_bits
from swarm.wire.work import MIN_BITS, WORK_PRICE, WorkStamp, epoch_of

MAX_SPENT = 2**18  # stamps remembered (16 bytes each)


class StampCheck:
    """Credits work stamps at ``price`` hashes per unit of cost, each once."""

    def __init__(self, price: float = WORK_PRICE, max_spent: int = MAX_SPENT):
        if price <= 0 or max_spent < 1:
            raise ValueError("price must be positive and max_spent at least 1")
        self.price, self.max_spent = price, max_spent
        self.spent: dict[int, set[bytes]] = {}  # epoch -> digests credited
        self.refused: Counter[str] = Counter()  # why stamps were credited nothing
        self.credited = 0

    def credit(self, stamp: Optional[WorkStamp], server: str, caller: str, now: float) -> float:
        """Units of cost ``stamp`` proves for ``caller`` at ``server`` now (0 for none, or one that fails a check)."""
        if stamp is None:
            return 0.0
        epoch = epoch_of(now)
        for old in [old for old in self.spent if old < epoch - 1]:
            del self.spent[old]
        if abs(stamp.epoch - epoch) > 1:
            return self._refuse("stale")
        digest = stamp.digest(server, caller)
        bits = leading_zero_bits(digest)
        if bits < MIN_BITS:
            return self._refuse("short")
        key = digest[:16]
        if any(key in spent for spent in self.spent.values()):
            return self._refuse("spent")
        if sum(len(spent) for spent in self.spent.values()) >= self.max_spent:
            return self._refuse("full")
        self.spent.setdefault(stamp.epoch, set()).add(key)
        self.credited += 1
        return 2.0**bits / self.price

    def _refuse(self, why: str) -> float:
        self.refused[why] += 1
        return 0.0

    def info(self) -> dict:
        return {"credited": self.credited, "remembered": sum(len(spent) for spent in self.spent.values()),
                "refused": dict(self.refused)}
