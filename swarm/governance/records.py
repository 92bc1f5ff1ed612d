"""Signed halt / resume decisions on the DHT, and the state they add up to.

Each governance key has its own DHT key, ``{prefix}.governance.{KEY ID}`` (16 hex digits of the key's sha256): the one
slot there is the key's, at every storing peer, whatever it trusts (issue 55: 64 stranger slots under the shared key
at a peer that trusts no key made it refuse the real halt). Readers read the keys of the signers they trust. Decisions
are also written to the shared key of readers before issue 55, one slot per key under ``{prefix}.governance``: the
subkey ``[ed25519:PUBLIC KEY]`` (``swarm.dht.validation``), and readers read it too (decisions written before). Every
swarm peer refuses a write to a slot unless its key signed the DHT key, the payload and the expiration time, so nobody
else can fill the slot, and a replayed value cannot come back with a later expiration than it was signed with (a slot
keeps the value with the latest expiration). A peer that knows the prefix also refuses, under that key, plain subkeys,
values over 2 KiB and (when it trusts governance keys) the slots of keys it does not trust
(``swarm.dht.schema.protected_keys``): the key cannot be flooded past the size of a DHT reply on honest peers.

The payload (msgpack) holds action, reason, prefix, timestamp and a sequence number. :func:`publish` reads the
current decisions and signs a sequence above the newest one. Readers accept only records signed by a key they
trust, for their prefix, not from the future; they adopt the highest sequence (a halt wins a tie) and never go
back to a lower one, so an old record can never win. Anything else is ignored.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.dht import DHT
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.dht.keys import GOVERNANCE_OWN
from swarm.dht.schema import forget_local_copies, governance_key, read_entries
from swarm.dht.validation import dht_key_id, sign_slot, signer_id, slot_signer, slot_subkey, verify_slot
from swarm.governance.keys import public_key_text
from swarm.governance.limits import HALT, MAX_STALE_AFTER, RESUME
from swarm.utils import fields
from swarm.utils.errors import EXIT_USAGE, SwarmError

logger = logging.getLogger(__name__)

RECORD_LIFETIME = 30 * 24 * 3600.0  # a halt stands until resumed; the DHT keeps it this long
MAX_CLOCK_SKEW = 300.0
_MAX_WARNINGS = 256  # distinct invalid records worth a warning line; the rest go to debug
MAX_REASON_CHARS = 512  # a decision's reason, as signed and as read
MAX_SEQUENCE = 2**63 - 1
# publish() reads its record back until this many seconds have passed, storing it again after each miss (on a busy
# machine a store or a read may reach no peer in time); the pauses between tries grow from 1 s to 8 s. An operator
# would rather wait a minute than be told a halt failed that a second store would have placed.
READ_BACK_SECONDS = 60.0
READ_BACK_PAUSES = (1.0, 2.0, 4.0, 8.0)


def check_stale_after(value: float, name: str = "governance_stale_after") -> float:
    """A fail-safe bound (``GovernanceGuard``): 0 (off) or seconds up to a week."""
    if not isinstance(value, (int, float)) or not 0 <= value <= MAX_STALE_AFTER:
        raise ValueError(f"{name} must be 0 (off) or at most {MAX_STALE_AFTER:.0f} seconds, got {value}")
    return value


def own_governance_key(prefix: str, signer: str) -> str:
    """The key only ``signer`` (base64 public key) writes its decisions under."""
    return GOVERNANCE_OWN.key(prefix=prefix, signer=signer_id(signer))


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


class UntrustedRecord(SwarmError, ValueError):
    """A record that is not a governance decision by a trusted key: not worth a warning."""

    exit_code = EXIT_USAGE


def sign_decision(key: Ed25519PrivateKey, prefix: str, action: str, reason: str, sequence: int, expiration: float,
                  timestamp: Optional[float] = None, dht_key: Optional[str] = None) -> dict:
    """The value to store in ``key``'s slot with exactly ``expiration`` (the signature covers it) under ``dht_key``
    (default: the shared governance key)."""
    if action not in (HALT, RESUME):
        raise ValueError(f"action must be {HALT!r} or {RESUME!r}")
    if len(reason) > MAX_REASON_CHARS:
        raise ValueError(f"the reason must be at most {MAX_REASON_CHARS} characters")
    body = {"action": action, "reason": reason, "prefix": prefix, "sequence": int(sequence),
            "timestamp": time.time() if timestamp is None else float(timestamp)}
    return sign_slot(key, dht_key or governance_key(prefix), MSGPackSerializer.dumps(body), expiration)


def parse_decision(prefix: str, subkey: Any, value: Any, expiration: float,
                   trusted: Mapping[str, Ed25519PublicKey], dht_key: Optional[str] = None) -> Decision:
    """The decision a stored record carries under ``dht_key`` (default: the shared key); ValueError
    (:class:`UntrustedRecord` if not ours) saying why not."""
    signer = slot_signer(subkey)
    if signer is None or signer not in trusted:
        raise UntrustedRecord(f"not a slot of a trusted key: {str(subkey)[:40]!r}")
    if dht_key is not None and dht_key not in (governance_key(prefix), own_governance_key(prefix, signer)):
        raise UntrustedRecord(f"a slot of {signer[:12]}... under another key's governance key")
    payload = verify_slot(dht_key_id(dht_key or governance_key(prefix)), subkey, value, expiration)
    try:
        body = MSGPackSerializer.loads(payload)
        if not isinstance(body, dict):
            raise ValueError("not a map")
        claimed = body.get("prefix")
    except Exception as error:  # a trusted key signed something that is not a decision: msgpack raises many types
        raise ValueError(f"malformed decision payload: {type(error).__name__}") from None
    if claimed != prefix:
        raise ValueError(f"record is for prefix {str(claimed)[:80]!r}")
    try:
        decision = Decision(fields.text(body.get("action"), 16), fields.text(body.get("reason"), MAX_REASON_CHARS),
                            fields.number(body.get("timestamp"), 0.0, time.time() + MAX_CLOCK_SKEW), signer,
                            fields.integer(body.get("sequence"), 0, MAX_SEQUENCE))
    except ValueError as error:
        raise ValueError(f"malformed decision: {error}") from None
    if decision.action not in (HALT, RESUME):
        raise ValueError(f"unknown action {decision.action!r}")
    return decision


def _stored_records(dht: DHT, prefix: str, signers: Iterable[str]) -> list[tuple[str, Any, Any, float]]:
    """(key, subkey, value, expiration) of every entry under the shared governance key and the own keys of
    ``signers`` (base64), valid or not: one read."""
    keys = [governance_key(prefix), *(own_governance_key(prefix, signer) for signer in sorted(signers))]
    return [(key, subkey, value, expiration) for key, entries in read_entries(dht, keys).items()
            for subkey, (value, expiration) in entries.items()]


def read_decisions(dht: DHT, prefix: str, trusted: Mapping[str, Ed25519PublicKey]) -> list[tuple[Decision, float]]:
    """Every valid decision by a trusted key, once (a decision is stored under its key's own key and the shared one),
    with the latest expiration it was stored with."""
    decisions: dict[Decision, float] = {}
    for key, subkey, value, expiration in _stored_records(dht, prefix, trusted):
        try:
            decision = parse_decision(prefix, subkey, value, expiration, trusted, key)
        except ValueError as error:
            logger.debug("ignoring a governance record: %s", error)
            continue
        decisions[decision] = max(expiration, decisions.get(decision, expiration))
    return list(decisions.items())


def publish(dht: DHT, key: Ed25519PrivateKey, prefix: str, action: str, reason: str,
            timestamp: Optional[float] = None, trusted: Iterable[Ed25519PublicKey] = (),
            read_back_seconds: float = READ_BACK_SECONDS) -> Optional[Decision]:
    """Sign and store a decision that outranks every current one of ``key`` and ``trusted``; the decision once
    readers get it back from the swarm, None if they do not (a peer's "stored" proves nothing: what counts is
    what readers read, and a flooded key may be unreadable).

    The sequence is above the newest such decision and at least the time in milliseconds, so decisions of
    keys that cannot see each other still order by time.
    """
    own = public_key_text(key)
    keys = {public_key_text(k): k for k in trusted} | {own: key.public_key()}
    current = read_decisions(dht, prefix, keys)
    sequence = max([d.sequence + 1 for d, _ in current] + [int(time.time() * 1000)])
    # The slot keeps the value with the latest expiration: ours must be later than the one it replaces.
    expiration = max([get_dht_time() + RECORD_LIFETIME] + [e + 1.0 for d, e in current if d.signer == own])
    own_key = own_governance_key(prefix, own)
    timestamp = time.time() if timestamp is None else timestamp
    value = sign_decision(key, prefix, action, reason, sequence, expiration, timestamp, own_key)
    shared = sign_decision(key, prefix, action, reason, sequence, expiration, timestamp)  # for readers before issue 55
    decision = parse_decision(prefix, governance_subkey(key), value, expiration, keys, own_key)
    stored, deadline = False, time.monotonic() + read_back_seconds
    for attempt in itertools.count():
        stored = dht.store(own_key, value, expiration_time=expiration, subkey=governance_subkey(key)) or stored
        dht.store(governance_key(prefix), shared, expiration_time=expiration, subkey=governance_subkey(key))
        forget_local_copies(dht, [own_key, governance_key(prefix)])  # what readers get, not this peer's own copy
        read = read_decisions(dht, prefix, {own: key.public_key()})
        if any(found == decision for found, _ in read):
            if not stored:
                logger.info("a peer refused the record, but the swarm returns it")
            return decision
        pause = READ_BACK_PAUSES[min(attempt, len(READ_BACK_PAUSES) - 1)]
        if time.monotonic() + pause >= deadline:
            break
        seen = ", ".join(f"{d.action} #{d.sequence}" for d, _ in read) or "nothing of this key"
        logger.warning("the decision is not read back yet (try %d; readers get %s): storing it again in %.0f s",
                       attempt + 1, seen, pause)
        time.sleep(pause)
    logger.warning("the decision was %s but readers do not get it back from the swarm",
                   "stored" if stored else "refused")
    return None


class GovernanceState:
    """Tracks the highest-ranked valid decision for one prefix, given the trusted public keys, and when a valid
    decision was last read (a reader that reads none for long may be blinded: ``GovernanceGuard`` fails safe)."""

    def __init__(self, prefix: str, trusted: Iterable[Ed25519PublicKey]):
        self.prefix = prefix
        self.trusted = {public_key_text(k): k for k in trusted}
        self.current: Optional[Decision] = None
        self.seen_at: Optional[float] = None  # time.monotonic() of the last read that returned a valid decision
        self._warned: set[str] = set()

    @property
    def enabled(self) -> bool:
        return bool(self.trusted)

    @property
    def halted(self) -> bool:
        return self.current is not None and self.current.halted

    def parse(self, subkey: Any, value: Any, expiration: float, dht_key: Optional[str] = None) -> Optional[Decision]:
        """The valid trusted decision a record stored under ``dht_key`` (default: the shared key) carries, or None
        (never raises: records are remote input)."""
        try:
            return parse_decision(self.prefix, subkey, value, expiration, self.trusted, dht_key)
        except UntrustedRecord as error:
            logger.debug("ignoring a governance record: %s", error)
        except Exception as error:  # ValueError for what it says; anything else is junk all the same
            self._warn_once(f"ignoring an invalid governance record: {str(error)[:200]}")
        return None

    def consider(self, subkey: Any, value: Any, expiration: float, dht_key: Optional[str] = None) -> Optional[Decision]:
        """Check one stored record; adopt it if valid and it outranks the current decision."""
        decision = self.parse(subkey, value, expiration, dht_key)
        if decision is None:
            return None
        self.seen_at = time.monotonic()
        if not decision.outranks(self.current):
            return None
        logger.warning("governance: %s #%d (%s) signed at %.0f", decision.action, decision.sequence,
                       decision.reason, decision.timestamp)
        self.current = decision
        return decision

    def refresh(self, dht: DHT) -> Optional[Decision]:
        """Read every record under the governance keys of the trusted signers (and the shared one) and adopt the
        highest-ranked valid one."""
        if not self.enabled:
            return None
        for key, subkey, value, expiration in _stored_records(dht, self.prefix, self.trusted):
            self.consider(subkey, value, expiration, key)
        return self.current

    def _warn_once(self, message: str) -> None:
        """Readers poll every second: one line per distinct problem, not one per poll."""
        if message in self._warned or len(self._warned) >= _MAX_WARNINGS:
            logger.debug(message)
            return
        self._warned.add(message)
        logger.warning(message)
