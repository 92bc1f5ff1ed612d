"""Stream records on the DHT: a stream coordinator's signed statement of the swarm's domain streams (issue 57).

A coordinator holds an Ed25519 key (made like a governance or auditor key) and publishes, under
``{prefix}.streams.{ITS PUBLIC KEY}`` (``swarm.dht.keys.STREAMS``: the one slot that key may write, so no flood of
other keys' slots can take it), one record: per stream its name, task, weight, audited curve (the best trusted score
round by round, from the auditors' reports it trusts), its pool (the nodes the scheduler of
``swarm.improve.streams`` assigned to it) and its claim (the nodes its run says work for it, with the work each did:
optimizer steps since the assignment). Readers read only the coordinators they trust (``--trusted-coordinators``);
a record signed by any other key, under another coordinator's key, malformed, oversized, for another model or from
the future is no record (:func:`record_of`), and a stream whose claim holds nodes outside its pool or nodes that did
no work is flagged (``streams.check_claim``), as is a pool size that does not follow the weights
(``streams.pool_sizes``): a reader sees it, whatever its coordinator says.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional

from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.adapters.sharing import signed_entries, store_slot
from swarm.dht.config import MAX_AUDIT_LIFETIME
from swarm.dht.keys import STREAMS
from swarm.dht.validation import MAX_SLOT_PAYLOAD, ed25519_text
from swarm.improve.streams import ClaimError, Stream, check_claim, pool_sizes
from swarm.utils import fields

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from hivemind.dht import DHT

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
MAX_STREAMS = 16  # streams one record lists
MAX_NODES = 64  # nodes in all pools of one record, and in all claims
MAX_CURVE = 32  # rounds of a stream's curve
MAX_TASK_CHARS = 32
MAX_WEIGHT = 1e6
MAX_WORK = 2**31
MAX_PATIENCE = 100
MAX_SEQUENCE = 2**53
MAX_PREFIX_CHARS = 256
MAX_CLOCK_SKEW = 300.0
MAX_RECORD_KEYS = 8
MAX_ENTRY_KEYS = 8
MAX_RECORD_BYTES = MAX_SLOT_PAYLOAD  # 16 KiB: 64 nodes of 64 characters in pools and claims fit with room
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
NODE = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,64}")  # a libp2p peer id, base58


@dataclass(frozen=True)
class StreamEntry:
    """One stream as its coordinator states it."""

    name: str
    task: str
    weight: float
    curve: tuple[float, ...] = ()
    pool: tuple[str, ...] = ()  # the nodes assigned to it
    claimed: tuple[str, ...] = ()  # the nodes its run says work for it
    worked: tuple[int, ...] = ()  # per claimed node, the work it did for the stream since the assignment

    @property
    def stream(self) -> Stream:
        return Stream(self.name, self.weight, self.curve)

    def to_value(self) -> dict[str, Any]:
        return {"name": self.name, "task": self.task, "weight": self.weight, "curve": list(self.curve),
                "pool": list(self.pool), "claimed": list(self.claimed), "worked": list(self.worked)}

    @classmethod
    def from_value(cls, raw: Any) -> "StreamEntry":
        """One stream, every field checked; ValueError saying why not."""
        if not isinstance(raw, dict) or len(raw) > MAX_ENTRY_KEYS:
            raise ValueError(f"a stream is a map of at most {MAX_ENTRY_KEYS} fields")
        name, task = fields.text(raw.get("name"), 65), fields.text(raw.get("task"), MAX_TASK_CHARS + 1)
        if not NAME.fullmatch(name) or not NAME.fullmatch(task) or len(task) > MAX_TASK_CHARS:
            raise ValueError("a stream's name and task are 1-64 (task: 1-32) letters, digits, '_', '.' or '-'")
        curve = raw.get("curve")
        if not isinstance(curve, list) or len(curve) > MAX_CURVE:
            raise ValueError(f"a curve is a list of at most {MAX_CURVE} scores")
        claimed, worked = nodes(raw.get("claimed")), raw.get("worked")
        if not isinstance(worked, list) or len(worked) != len(claimed):
            raise ValueError("worked holds one count per claimed node")
        return cls(name, task, fields.number(raw.get("weight"), 0.0, MAX_WEIGHT),
                   tuple(fields.number(score, 0.0, 1.0) for score in curve), nodes(raw.get("pool")), claimed,
                   tuple(fields.integer(count, 0, MAX_WORK) for count in worked))


def nodes(raw: Any) -> tuple[str, ...]:
    """A list of distinct peer ids, at most :data:`MAX_NODES`."""
    if not isinstance(raw, list) or len(raw) > MAX_NODES:
        raise ValueError(f"a list of at most {MAX_NODES} peer ids")
    if not all(isinstance(node, str) and NODE.fullmatch(node) for node in raw) or len(set(raw)) != len(raw):
        raise ValueError("peer ids are base58, at most 64 characters, each once")
    return tuple(raw)


@dataclass(frozen=True)
class StreamRecord:
    """One coordinator's streams for one model (see the module doc)."""

    prefix: str
    sequence: int
    published: float
    entries: tuple[StreamEntry, ...]
    patience: int = 3  # rounds without an audited gain after which a stream has stalled
    coordinator: str = ""  # the signing key (base64), filled in from the slot when read

    def assignment(self) -> dict[str, str]:
        return {node: entry.name for entry in self.entries for node in entry.pool}

    def check(self) -> None:
        """ValueError for what no reader accepts: an entry its parser refuses, too many streams or nodes, a name twice,
        a node in two pools."""
        for entry in self.entries:
            StreamEntry.from_value(entry.to_value())  # every field as a reader checks it
        if len(self.entries) > MAX_STREAMS or len({e.name for e in self.entries}) != len(self.entries):
            raise ValueError(f"at most {MAX_STREAMS} streams, each name once")
        pooled = [node for entry in self.entries for node in entry.pool]
        if len(pooled) > MAX_NODES or len(set(pooled)) != len(pooled):
            raise ValueError(f"at most {MAX_NODES} nodes in all, each in one pool")
        if sum(len(entry.claimed) for entry in self.entries) > MAX_NODES:
            raise ValueError(f"at most {MAX_NODES} claimed nodes in all")
        if not 1 <= self.patience <= MAX_PATIENCE:
            raise ValueError(f"patience is 1-{MAX_PATIENCE} rounds")

    def payload(self) -> bytes:
        """The signed bytes; ValueError when the record breaks a bound readers enforce."""
        self.check()
        payload = MSGPackSerializer.dumps({
            "record_version": RECORD_VERSION, "prefix": self.prefix, "sequence": self.sequence,
            "published": self.published, "patience": self.patience, "streams": [e.to_value() for e in self.entries]})
        if len(payload) > MAX_RECORD_BYTES:
            raise ValueError(f"a stream record of {len(payload)} bytes is over the bound of {MAX_RECORD_BYTES}")
        return payload

    @classmethod
    def from_payload(cls, payload: Any, coordinator: str, prefix: str, now: Optional[float] = None) -> "StreamRecord":
        """Parse a verified payload for ``prefix``; ValueError for anything malformed, oversized, from the future or
        for another model."""
        body = fields.record_body(payload, MAX_RECORD_BYTES, RECORD_VERSION, MAX_RECORD_KEYS, "a stream record")
        claimed = fields.text(body.get("prefix"), MAX_PREFIX_CHARS)
        if claimed != prefix:
            raise ValueError(f"a stream record for prefix {claimed[:80]!r}, not {prefix[:80]!r}")
        streams = body.get("streams")
        if not isinstance(streams, list) or len(streams) > MAX_STREAMS:
            raise ValueError(f"streams must be a list of at most {MAX_STREAMS}")
        latest = (time.time() if now is None else now) + MAX_CLOCK_SKEW
        record = cls(claimed, fields.integer(body.get("sequence"), 0, MAX_SEQUENCE),
                     fields.number(body.get("published"), 0.0, latest),
                     tuple(StreamEntry.from_value(raw) for raw in streams),
                     fields.integer(body.get("patience"), 1, MAX_PATIENCE), coordinator)
        record.check()
        return record

    def views(self) -> list[dict[str, Any]]:
        """What ``swarm.health --json`` and the web map show: per stream its weight, pool, curve, whether stalled, and
        ``flags``: why a reader should not take its coordinator's word for it (a claim ``check_claim`` refuses, a
        pool size the weights do not give)."""
        assignment = self.assignment()
        sizes = pool_sizes([e.stream for e in self.entries], len(assignment), self.patience)
        views = []
        for entry in self.entries:
            flags = []
            try:
                check_claim(entry.name, entry.claimed, assignment, dict(zip(entry.claimed, entry.worked)))
            except ClaimError as error:
                flags.append(f"claim refused: {error}")
            if len(entry.pool) != sizes[entry.name]:
                flags.append(f"pool of {len(entry.pool)} where the weights give {sizes[entry.name]}")
            views.append({"stream": entry.name, "task": entry.task, "weight": entry.weight, "pool": list(entry.pool),
                          "curve": list(entry.curve), "stalled": entry.stream.stalled(self.patience),
                          "coordinator": self.coordinator, "flags": flags})
        return views


def record_of(slots: Iterable[tuple[str, bytes]], coordinator: str, prefix: str,
              now: Optional[float] = None) -> Optional[StreamRecord]:
    """The coordinator's newest valid record among verified (signer, payload) slots; another signer's slot, and
    whatever does not parse, is none."""
    found = None
    for signer, payload in slots:
        if signer != coordinator:
            continue  # another key's slot under this coordinator's key: never its record
        try:
            record = StreamRecord.from_payload(payload, signer, prefix, now)
        except Exception as error:  # remote input: whatever went wrong, it is not a record
            logger.debug("ignoring a malformed stream record by %s: %s", coordinator[:12], str(error)[:200])
            continue
        if found is None or record.sequence > found.sequence:
            found = record
    return found


# ----- on the DHT ------------------------------------------------------------------------------------------------
def streams_key(prefix: str, coordinator: str) -> str:
    return STREAMS.key(prefix=prefix, coordinator=coordinator)


def read_streams(dht: DHT, prefix: str, coordinator: str) -> Optional[StreamRecord]:
    """The record ``coordinator`` (base64 public key) signed for ``prefix``, or None."""
    return record_of(signed_entries(dht, streams_key(prefix, coordinator)), coordinator, prefix)


def read_trusted_streams(dht: DHT, prefix: str, coordinators: Iterable[str]) -> list[dict[str, Any]]:
    """The streams of every trusted coordinator's record (their :meth:`StreamRecord.views`); never raises."""
    views = []
    for coordinator in sorted(set(coordinators)):
        try:
            record = read_streams(dht, prefix, coordinator)
        except Exception as error:  # an unreachable DHT: no streams shown, the map still is
            logger.warning("could not read the streams of %s: %r", coordinator[:12], error)
            continue
        views += record.views() if record is not None else []
    return views


def publish_streams(dht: DHT, key: Ed25519PrivateKey, record: StreamRecord, lifetime: float) -> bool:
    """Sign and store ``record`` in ``key``'s slot for ``lifetime`` seconds: whether a storing peer took it."""
    expiration = get_dht_time() + min(lifetime, MAX_AUDIT_LIFETIME - 60.0)
    return store_slot(dht, key, streams_key(record.prefix, ed25519_text(key)), record.payload(), expiration)
