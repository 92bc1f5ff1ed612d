"""A call's work stamp as a value (:mod:`swarm.wire.work` mints, parses and prices them): what a request carries,
apart from the minting and parsing, so that the request types (:mod:`swarm.wire.messages`) can name it."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from swarm.utils.hashcash import leading_zero_bits

DOMAIN = b"swarm-work-v1"


@dataclass(frozen=True)
class WorkStamp:
    """One proof: ``counter`` under ``salt`` in ``epoch``; worth ``2**bits`` hashes once checked (:meth:`bits`)."""

    epoch: int
    salt: str
    counter: int

    def digest(self, server: str, caller: str) -> bytes:
        """What the work is over: the domain, both peer ids, the epoch, the salt and the counter."""
        return _with_counter(_prefix(server, caller, self.epoch, self.salt), self.counter)

    def bits(self, server: str, caller: str) -> int:
        """Leading zero bits of :meth:`digest`: the work this stamp proves for ``caller`` at ``server``."""
        return leading_zero_bits(self.digest(server, caller))

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "salt": self.salt, "counter": self.counter}


def _prefix(server: str, caller: str, epoch: int, salt: str) -> "hashlib._Hash":
    """The hash of everything but the counter (each field length-prefixed, so no two tuples hash alike)."""
    fields = (server.encode(), caller.encode(), str(epoch).encode(), salt.encode())
    return hashlib.sha256(DOMAIN + b"".join(len(field).to_bytes(2, "big") + field for field in fields))


def _with_counter(prefix: "hashlib._Hash", counter: int) -> bytes:
    hashed = prefix.copy()
    hashed.update(counter.to_bytes(8, "big"))
    return hashed.digest()
