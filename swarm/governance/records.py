"""Signed halt / resume decisions on the DHT, and the state they add up to.

Each governance key has one slot under ``{prefix}.governance``: the subkey ``[ed25519:PUBLIC KEY]``
(``swarm.dht.validation``). Every swarm peer refuses a write to that slot unless that key signed the DHT key,
the payload and the expiration time, so nobody else can fill the slot, and a replayed value cannot come back
with a later expiration than it was signed with (a slot keeps the value with the latest expiration).

The payload (msgpack) holds action, reason, prefix, timestamp and a sequence number. :func:`publish` reads the
current decisions and signs a sequence above the newest one. Readers accept only records signed by a key they
trust, for their prefix, not from the future; they adopt the highest sequence (a halt wins a tie) and never go
back to a lower one, so an old record can never win. Anything else is ignored.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.dht import DHT
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.dht.validation import dht_key_id, sign_slot, slot_signer, slot_subkey, verify_slot
from swarm.governance.keys import public_key_text

logger = logging.getLogger(__name__)

HALT, RESUME = "halt", "resume"
RECORD_LIFETIME = 30 * 24 * 3600.0  # a halt stands until resumed; the DHT keeps it this long
MAX_CLOCK_SKEW = 300.0
_MAX_WARNINGS = 256  # distinct invalid records worth a warning line; the rest go to debug


def governance_key(prefix: str) -> str:
    return f"{prefix}.governance"


def governance_subkey(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The one slot a governance key writes under."""
    return slot_subkey(key)


@dataclass(frozen=True)
class Decision:
    action: str
    reason: str
    timestamp: float
    signer: str  # base64 public key
    sequence: int = 0

    @property
    def halted(self) -> bool:
        return self.action == HALT

    def outranks(self, other: Optional["Decision"]) -> bool:
        """Higher sequence wins; on a tie (two keys at once) a halt wins, then the signer decides."""
        return other is None or (self.sequence, self.halted, self.signer) > (other.sequence, other.halted, other.signer)


class UntrustedRecord(ValueError):
    """A record that is not a governance decision by a trusted key: not worth a warning."""


def sign_decision(key: Ed25519PrivateKey, prefix: str, action: str, reason: str, sequence: int, expiration: float,
                  timestamp: Optional[float] = None) -> dict:
    """The value to store in ``key``'s slot with exactly ``expiration`` (the signature covers it)."""
    if action not in (HALT, RESUME):
        raise ValueError(f"action must be {HALT!r} or {RESUME!r}")
    body = {"action": action, "reason": reason, "prefix": prefix, "sequence": int(sequence),
            "timestamp": time.time() if timestamp is None else float(timestamp)}
    return sign_slot(key, governance_key(prefix), MSGPackSerializer.dumps(body), expiration)


def parse_decision(prefix: str, subkey: Any, value: Any, expiration: float,
                   trusted: Mapping[str, Ed25519PublicKey]) -> Decision:
    """The decision a stored record carries; ValueError (:class:`UntrustedRecord` if not ours) saying why not."""
    signer = slot_signer(subkey)
    if signer is None or signer not in trusted:
        raise UntrustedRecord(f"not a slot of a trusted key: {str(subkey)[:40]!r}")
    payload = verify_slot(dht_key_id(governance_key(prefix)), subkey, value, expiration)
    try:
        body = MSGPackSerializer.loads(payload)
        decision = Decision(body["action"], body["reason"], float(body["timestamp"]), signer, body["sequence"])
    except Exception as error:  # a trusted key signed something that is not a decision
        raise ValueError(f"malformed decision payload: {error!r}") from None
    if body.get("prefix") != prefix:
        raise ValueError(f"record is for prefix {body.get('prefix')!r}")
    if decision.action not in (HALT, RESUME) or not isinstance(decision.reason, str):
        raise ValueError(f"unknown action {decision.action!r} or reason type")
    if not isinstance(decision.sequence, int) or isinstance(decision.sequence, bool) or decision.sequence < 0:
        raise ValueError(f"bad sequence {decision.sequence!r}")
    if not math.isfinite(decision.timestamp) or decision.timestamp > time.time() + MAX_CLOCK_SKEW:
        raise ValueError("timestamp in the future")
    return decision


def _stored_records(dht: DHT, prefix: str) -> list[tuple[Any, Any, float]]:
    """(subkey, value, expiration) of every entry under the governance key, valid or not."""
    found = dht.get(governance_key(prefix), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    return [(subkey, item.value, item.expiration_time) for subkey, item in found.value.items()]


def read_decisions(dht: DHT, prefix: str, trusted: Mapping[str, Ed25519PublicKey]) -> list[tuple[Decision, float]]:
    """Every valid decision by a trusted key, with the expiration it was stored with."""
    decisions = []
    for subkey, value, expiration in _stored_records(dht, prefix):
        try:
            decisions.append((parse_decision(prefix, subkey, value, expiration, trusted), expiration))
        except ValueError as error:
            logger.debug("ignoring a governance record: %s", error)
    return decisions


def publish(dht: DHT, key: Ed25519PrivateKey, prefix: str, action: str, reason: str,
            timestamp: Optional[float] = None, trusted: Iterable[Ed25519PublicKey] = ()) -> Optional[Decision]:
    """Sign and store a decision that outranks every current one of ``key`` and ``trusted``; None if unstored.

    The sequence is above the newest such decision and at least the time in milliseconds, so decisions of
    keys that cannot see each other still order by time.
    """
    own = public_key_text(key)
    keys = {public_key_text(k): k for k in trusted} | {own: key.public_key()}
    current = read_decisions(dht, prefix, keys)
    sequence = max([d.sequence + 1 for d, _ in current] + [int(time.time() * 1000)])
    # The slot keeps the value with the latest expiration: ours must be later than the one it replaces.
    expiration = max([get_dht_time() + RECORD_LIFETIME] + [e + 1.0 for d, e in current if d.signer == own])
    value = sign_decision(key, prefix, action, reason, sequence, expiration, timestamp)
    decision = parse_decision(prefix, governance_subkey(key), value, expiration, keys)
    if dht.store(governance_key(prefix), value, expiration_time=expiration, subkey=governance_subkey(key)):
        return decision
    # The answer is the last replica's, and a hostile peer may say no; what counts is what readers get back.
    if any(found == decision for found, _ in read_decisions(dht, prefix, {own: key.public_key()})):
        logger.info("a peer refused the record, but the swarm returns it")
        return decision
    return None


class GovernanceState:
    """Tracks the highest-ranked valid decision for one prefix, given the trusted public keys."""

    def __init__(self, prefix: str, trusted: Iterable[Ed25519PublicKey]):
        self.prefix = prefix
        self.trusted = {public_key_text(k): k for k in trusted}
        self.current: Optional[Decision] = None
        self._warned: set[str] = set()

    @property
    def enabled(self) -> bool:
        return bool(self.trusted)

    @property
    def halted(self) -> bool:
        return self.current is not None and self.current.halted

    def consider(self, subkey: Any, value: Any, expiration: float) -> Optional[Decision]:
        """Check one stored record; adopt it if valid and it outranks the current decision."""
        try:
            decision = parse_decision(self.prefix, subkey, value, expiration, self.trusted)
        except UntrustedRecord as error:
            logger.debug("ignoring a governance record: %s", error)
            return None
        except ValueError as error:
            self._warn_once(f"ignoring an invalid governance record: {error}")
            return None
        if not decision.outranks(self.current):
            return None
        logger.warning("governance: %s #%d (%s) signed at %.0f", decision.action, decision.sequence,
                       decision.reason, decision.timestamp)
        self.current = decision
        return decision

    def refresh(self, dht: DHT) -> Optional[Decision]:
        """Read every record under the governance key and adopt the highest-ranked valid one."""
        if not self.enabled:
            return None
        for subkey, value, expiration in _stored_records(dht, self.prefix):
            self.consider(subkey, value, expiration)
        return self.current

    def _warn_once(self, message: str) -> None:
        """Readers poll every second: one line per distinct problem, not one per poll."""
        if message in self._warned or len(self._warned) >= _MAX_WARNINGS:
            logger.debug(message)
            return
        self._warned.add(message)
        logger.warning(message)
