"""Proof of work a caller attaches to a request, so that a busy server's order can weigh what identities cost.

Peer ids are free, so a server that gives each id a share gives an attacker as many shares as it makes ids. A *work
stamp* is a hashcash-style proof (like a DHT list entry's, :mod:`swarm.dht.stamp`, which prices an entry once per
list; this one prices each call, for one server): a counter such that
``sha256(domain | server | caller | epoch | salt | counter)`` starts with ``bits`` zero bits, which took about
``2**bits`` hashes to find and takes one hash to check (a few microseconds). It names the server and the caller, so
it is worth nothing anywhere else or to anyone else, and a minute-long ``epoch`` (the server accepts the one before
and after its own, for clock skew); the server remembers the stamps it credited until their epochs pass, so none is
spent twice. The epoch is the clock's, so stamps for a later one can be made ahead (saved-up work spent in a burst,
at the same price per pass); a nonce the server hands out would close that, at a round trip.

A client mints, per call, a stamp worth the call's cost (:func:`swarm.models.cost.request_cost`) at
``price`` hashes per unit of cost; the server credits ``2**bits / price`` units to the caller
(:mod:`swarm.server.scheduler`). What a stamp buys is a place in the fair order, never admission: a request without
one is served as it was, in the newcomers' shared turn.

A server remembers the stamps it credited in a bounded table; once full, it credits only stamps worth more than a
*floor* that rises with what it had to forget (:mod:`swarm.server.work_check`), and announces the floor in its
answers (``floor`` beside ``contended``). A client mints its stamps for that server above it, up to
:data:`MAX_FLOOR_BITS`: a floor beyond that (a flood paid in GPU hours, or a lying server) leaves its calls unstamped,
in the newcomers' turn, rather than cost it more than a second of CPU per call.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import secrets
import time
from collections import OrderedDict
from typing import Any, Callable

from swarm.models.config import ModelConfig
from swarm.models.cost import attention_length_scale, request_cost
from swarm.wire.messages import ErrorCode, ForwardRequest, RemoteError
from swarm.wire.stamp_value import WorkStamp, _prefix, _with_counter

EPOCH_S = 60.0
WORK_PRICE = 16.0  # hashes per unit of cost (one position through a pass): see docs/GOVERNANCE.md for what it buys
MIN_BITS = 10  # the least a stamp must prove to be credited (and remembered): about 1,000 hashes
NO_FLOOR = MIN_BITS - 1  # the floor of a server whose table of spent stamps forgot nothing: MIN_BITS is credited
MAX_FLOOR_BITS = 20  # a client mints above an announced floor up to this (about a million hashes, a second of CPU)
MAX_BITS = 40  # more than any caller finds in an epoch; a client never mints more
INLINE_BITS = 10  # a stamp this small is minted on the event loop (about a millisecond); larger ones on a thread
BUSY_S = 60.0  # a client stamps its calls to a server until this long after it last answered "contended"
SALT_HEX = 16  # hex digits of a stamp's salt


def epoch_of(now: float) -> int:
    return int(now // EPOCH_S)


def bits_for(cost: float, price: float) -> int:
    """Zero bits a stamp needs to be worth ``cost`` at ``price`` hashes per unit (at least :data:`MIN_BITS`)."""
    return min(MAX_BITS, max(MIN_BITS, math.ceil(math.log2(max(1.0, cost * price)))))


def mint(server: str, caller: str, bits: int, now: float | None = None, salt: str | None = None) -> WorkStamp:
    """A stamp of at least ``bits`` zero bits for ``caller`` at ``server``: about ``2**bits`` hashes of CPU (``salt``:
    a fresh random one unless given)."""
    if not 0 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in 0..{MAX_BITS}, got {bits}")
    epoch = epoch_of(time.time() if now is None else now)
    salt = secrets.token_hex(SALT_HEX // 2) if salt is None else salt
    prefix = _prefix(server, caller, epoch, salt)
    threshold = 1 << (256 - bits)
    counter = 0
    while int.from_bytes(_with_counter(prefix, counter), "big") >= threshold:
        counter += 1
    return WorkStamp(epoch, salt, counter)


def parse_work(value: Any) -> WorkStamp:
    """A stamp from a request's ``extra["work"]``; :class:`RemoteError` (bad request) for anything malformed."""
    if not isinstance(value, dict) or set(value) != {"epoch", "salt", "counter"}:
        raise RemoteError(ErrorCode.BAD_REQUEST, "'work' must be a map of exactly epoch, salt and counter")
    epoch, salt, counter = value["epoch"], value["salt"], value["counter"]
    if not (_is_int(epoch) and 0 <= epoch < 2**40 and _is_int(counter) and 0 <= counter < 2**63):
        raise RemoteError(ErrorCode.BAD_REQUEST, "'work' epoch and counter must be non-negative integers in range")
    if not (isinstance(salt, str) and len(salt) == SALT_HEX and all(c in "0123456789abcdef" for c in salt)):
        raise RemoteError(ErrorCode.BAD_REQUEST, f"'work' salt must be {SALT_HEX} lowercase hex digits")
    return WorkStamp(epoch, salt, counter)


def announced_floor(metadata: dict) -> int:
    """The floor an answer's metadata announces (:data:`NO_FLOOR` when it names none, or names one malformed)."""
    floor = metadata.get("floor")
    return floor if _is_int(floor) and NO_FLOOR <= floor <= 256 else NO_FLOOR


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Stamper:
    """A client's side: forward requests stamped for their server, worth the request's ``cost`` (batch, length ->
    units, the servers' :func:`swarm.models.cost.request_cost`) at ``price`` hashes per unit.

    A stamp only matters while a server is contended, so a client stamps its first call to each server (a new
    client's first call is served in a turn of its own even during a flood), and then only until ``busy_s`` after
    the server last answered that a request of its had waited for another caller's (``contended``): on a server it
    has to itself a client mints nothing. A server that says "contended" when it is not costs the client stamps, at
    most one per call; one that never says so forgoes nothing it could not take anyway (it orders its own queue).
    Each stamp proves more than the floor the server last announced, up to ``max_floor_bits``; a higher floor leaves
    the calls unstamped (a stamp at or below it would be credited nothing)."""

    def __init__(self, caller: str, price: float, cost: Callable[[int, int], float], busy_s: float = BUSY_S,
                 max_servers: int = 1024, max_floor_bits: int = MAX_FLOOR_BITS):
        self.caller, self.price, self.cost, self.busy_s, self.max_servers = caller, price, cost, busy_s, max_servers
        self.max_floor_bits = max_floor_bits
        self.until: OrderedDict[str, float] = OrderedDict()  # server -> stamp its calls until then
        self.floors: dict[str, int] = {}  # server -> the floor its last answer announced, when raised
        self.minted = 0
        self.contended = 0  # answers that said a request had waited for another caller's

    def wanted(self, server: str, now: float) -> bool:
        return server not in self.until or now < self.until[server]

    def note(self, server: str, contended: bool, now: float | None = None, floor: int = NO_FLOOR) -> None:
        """An answer from ``server``: ``contended`` keeps this client stamping there for ``busy_s`` more; ``floor``
        (:func:`announced_floor`) is what its stamps there must prove more than."""
        now = time.time() if now is None else now
        self.contended += contended
        previous = self.until.pop(server, now)
        self.until[server] = now + self.busy_s if contended else min(previous, now + self.busy_s)
        if floor > NO_FLOOR:
            self.floors[server] = floor
        else:
            self.floors.pop(server, None)
        while len(self.until) > self.max_servers:
            self.floors.pop(self.until.popitem(last=False)[0], None)

    def bits(self, server: str, request: ForwardRequest) -> int | None:
        """The bits to stamp ``request`` for ``server`` with: its cost, and more than the server's floor (None when
        the floor is beyond ``max_floor_bits``)."""
        bits = bits_for(self.cost(*request.hidden.shape[:2]), self.price)
        floor = self.floors.get(server, NO_FLOOR)
        if floor < bits:
            return bits
        return floor + 1 if floor + 1 <= max(bits, self.max_floor_bits) else None

    async def stamp(self, server: str, request: ForwardRequest) -> ForwardRequest:
        """``request`` with a stamp worth its cost when one is wanted at ``server`` now, else as it is."""
        bits = self.bits(server, request) if self.wanted(server, time.time()) else None
        if bits is None:
            return request
        self.minted += 1
        work = mint(server, self.caller, bits) if bits <= INLINE_BITS else \
            await asyncio.to_thread(mint, server, self.caller, bits)
        return dataclasses.replace(request, work=work)


def stamper_for(caller: str, config: ModelConfig, price: float = WORK_PRICE) -> Stamper | None:
    """The stamper of a peer calling servers of the model of ``config`` as ``caller`` (None when ``price`` is 0): what
    a client, an auditor and a server handing pushes on all use, so that none is told apart by its stamps."""
    if not price:
        return None
    scale = attention_length_scale(config)
    return Stamper(caller, price, lambda batch, length: request_cost(batch, length, scale))
