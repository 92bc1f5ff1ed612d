"""The server's side of work stamps (:mod:`swarm.wire.work`): each checked in one hash and credited once.

A stamp is credited ``2**bits / price`` units of cost when it names this server and its caller, its epoch is this
server's or next to it, it proves at least :data:`~swarm.wire.work.MIN_BITS`, it was not credited before, and it
proves more than the *floor*. A stamp that fails any of these is counted and credited nothing; the request is served
all the same (a stamp buys a place in the order, never admission).

Credited stamps are remembered until their epoch is two behind, at most ``max_spent`` of them. The bound cannot be
filled for free: once it is reached, a new stamp worth more than the cheapest remembered one takes that one's place,
and the floor rises to the bits of the stamp forgotten until the forgotten stamp's epoch ages out, so that no
forgotten stamp can be credited twice (it is at or below the floor); a stamp at or below the floor, or, while the
table is full, at or below its cheapest stamp, is refused "below floor". Holding the floor at ``b`` bits costs an
attacker ``max_spent x 2**b`` hashes every two epochs (three at most, with stamps made ahead), and an honest caller
one stamp of ``b + 1`` bits per call (docs/GOVERNANCE.md). Servers announce the floor in their answers
(:func:`swarm.server.span_calls.answer_note`) and clients mint above it (:class:`swarm.wire.work.Stamper`). Each
stamp costs O(1): stamps are kept per epoch in buckets by bits, the cheapest found among the bits present (at most
256 of them), an epoch forgotten whole.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from swarm.dht.stamp import leading_zero_bits
from swarm.wire.work import MIN_BITS, NO_FLOOR, WORK_PRICE, WorkStamp, epoch_of

MAX_SPENT = 2**18  # stamps remembered (16 bytes each, and their buckets')


@dataclass
class _Epoch:
    """The stamps of one epoch credited and still remembered, by key and in buckets by bits."""

    bits: dict[bytes, int] = field(default_factory=dict)  # key -> bits it proved
    buckets: dict[int, dict[bytes, None]] = field(default_factory=dict)  # bits -> keys, oldest first; none empty
    floor: int = NO_FLOOR  # the most bits of a stamp of this epoch forgotten to make room

    def add(self, key: bytes, bits: int) -> None:
        self.bits[key] = bits
        self.buckets.setdefault(bits, {})[key] = None

    def forget_cheapest(self) -> None:
        """Forget the oldest of the cheapest stamps, raising the floor to its bits."""
        cheapest = min(self.buckets)
        bucket = self.buckets[cheapest]
        del self.bits[next(iter(bucket))]
        del bucket[next(iter(bucket))]
        if not bucket:
            del self.buckets[cheapest]
        self.floor = max(self.floor, cheapest)


class StampCheck:
    """Credits work stamps at ``price`` hashes per unit of cost, each once, above a floor (see the module doc)."""

    def __init__(self, price: float = WORK_PRICE, max_spent: int = MAX_SPENT):
        if price <= 0 or max_spent < 1:
            raise ValueError("price must be positive and max_spent at least 1")
        self.price, self.max_spent = price, max_spent
        self.epochs: dict[int, _Epoch] = {}  # epoch -> its stamps still remembered
        self.remembered = 0
        self.refused: Counter[str] = Counter()  # why stamps were credited nothing
        self.credited = 0
        self.forgotten = 0  # stamps forgotten to make room for a stamp worth more

    def credit(self, stamp: Optional[WorkStamp], server: str, caller: str, now: float) -> float:
        """Units of cost ``stamp`` proves for ``caller`` at ``server`` now (0 for none, or one that fails a check)."""
        if stamp is None:
            return 0.0
        epoch = epoch_of(now)
        self._age(epoch)
        if abs(stamp.epoch - epoch) > 1:
            return self._refuse("stale")
        digest = stamp.digest(server, caller)
        bits = leading_zero_bits(digest)
        if bits < MIN_BITS:
            return self._refuse("short")
        key = digest[:16]
        home = self.epochs.get(stamp.epoch)
        if home is not None and key in home.bits:
            return self._refuse("spent")
        if bits <= self._floor():
            return self._refuse("below floor")
        if self.remembered >= self.max_spent:
            self._cheapest_epoch().forget_cheapest()
            self.remembered -= 1
            self.forgotten += 1
        self.epochs.setdefault(stamp.epoch, _Epoch()).add(key, bits)
        self.remembered += 1
        self.credited += 1
        return 2.0**bits / self.price

    def floor(self, now: float) -> int:
        """The bits a stamp must prove more than to be credited now (:data:`NO_FLOOR` when nothing is forgotten
        and there is room): what a server announces to its callers."""
        self._age(epoch_of(now))
        return self._floor()

    def announced(self, now: float) -> Optional[int]:
        """The floor to tell a caller in an answer (None while it is at :data:`NO_FLOOR`: nothing to tell)."""
        floor = self.floor(now)
        return floor if floor > NO_FLOOR else None

    def _floor(self) -> int:
        floor = max((epoch.floor for epoch in self.epochs.values()), default=NO_FLOOR)
        if self.remembered >= self.max_spent:  # full: only a stamp worth more than the cheapest finds room
            floor = max(floor, min(self.epochs[self._cheapest_epoch_key()].buckets))
        return floor

    def _cheapest_epoch(self) -> _Epoch:
        return self.epochs[self._cheapest_epoch_key()]

    def _cheapest_epoch_key(self) -> int:
        """The epoch holding the cheapest stamp (the oldest such epoch: its floor ages out first)."""
        return min((epoch for epoch in self.epochs if self.epochs[epoch].buckets),
                   key=lambda epoch: (min(self.epochs[epoch].buckets), epoch))

    def _age(self, epoch: int) -> None:
        """Forget the epochs two or more behind ``epoch`` whole (their stamps are stale now, their floors too)."""
        for old in [old for old in self.epochs if old < epoch - 1]:
            self.remembered -= len(self.epochs.pop(old).bits)

    def _refuse(self, why: str) -> float:
        self.refused[why] += 1
        return 0.0

    def info(self) -> dict:
        return {"credited": self.credited, "remembered": self.remembered, "forgotten": self.forgotten,
                "floor": self._floor(), "refused": dict(self.refused)}
