"""Signed halt / resume records on the DHT, and the state they add up to.

A record is stored under ``{prefix}.governance`` with subkey ``{signing key}|{action}``: halts and resumes
live side by side, so replaying an old halt over the halt slot cannot hide a newer resume. Its value carries a
msgpack payload (action, reason, timestamp, prefix) and an Ed25519 signature over it. Readers accept only
records signed by a configured key, for this prefix, not from the future, and newer than the newest one
already accepted: a replayed old halt cannot undo a resume. Anything else is ignored and logged.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.dht import DHT
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.governance.keys import public_key_text, verify

logger = logging.getLogger(__name__)

HALT, RESUME = "halt", "resume"
RECORD_LIFETIME = 30 * 24 * 3600.0  # a halt stands until resumed; the DHT keeps it this long
MAX_CLOCK_SKEW = 300.0


def governance_key(prefix: str) -> str:
    return f"{prefix}.governance"


@dataclass(frozen=True)
class Decision:
    action: str
    reason: str
    timestamp: float
    signer: str  # base64 public key

    @property
    def halted(self) -> bool:
        return self.action == HALT


def sign_decision(key: Ed25519PrivateKey, prefix: str, action: str, reason: str, timestamp: Optional[float] = None) -> dict:
    if action not in (HALT, RESUME):
        raise ValueError(f"action must be {HALT!r} or {RESUME!r}")
    payload = MSGPackSerializer.dumps({"action": action, "reason": reason, "prefix": prefix,
                                       "timestamp": time.time() if timestamp is None else timestamp})
    return {"payload": payload, "signature": key.sign(payload)}


def publish(dht: DHT, key: Ed25519PrivateKey, prefix: str, action: str, reason: str,
            timestamp: Optional[float] = None) -> bool:
    value = sign_decision(key, prefix, action, reason, timestamp)
    return bool(dht.store(governance_key(prefix), value, expiration_time=get_dht_time() + RECORD_LIFETIME,
                          subkey=f"{public_key_text(key)}|{action}"))


class GovernanceState:
    """Tracks the newest valid decision for one prefix, given the trusted public keys."""

    def __init__(self, prefix: str, trusted: Iterable[Ed25519PublicKey]):
        self.prefix = prefix
        self.trusted = {public_key_text(k): k for k in trusted}
        self.current: Optional[Decision] = None

    @property
    def enabled(self) -> bool:
        return bool(self.trusted)

    @property
    def halted(self) -> bool:
        return self.current is not None and self.current.halted

    def consider(self, signer: Any, value: Any) -> Optional[Decision]:
        """Check one stored record; adopt it if valid and newer than the current decision."""
        decision = self._parse(signer, value)
        if decision is None:
            return None
        if self.current is not None and decision.timestamp <= self.current.timestamp:
            if decision != self.current:
                logger.info("ignoring an older governance record (%s at %.0f)", decision.action, decision.timestamp)
            return None
        logger.warning("governance: %s (%s) signed at %.0f", decision.action, decision.reason, decision.timestamp)
        self.current = decision
        return decision

    def _parse(self, signer: Any, value: Any) -> Optional[Decision]:
        if isinstance(signer, bytes):
            signer = signer.decode("utf-8", errors="replace")
        signer = signer.split("|", 1)[0] if isinstance(signer, str) else signer
        public = self.trusted.get(signer) if isinstance(signer, str) else None
        if public is None:
            logger.warning("ignoring a governance record signed by an unknown key %r", str(signer)[:16])
            return None
        try:
            payload, signature = value["payload"], value["signature"]
            if not verify(public, signature, payload):
                raise ValueError("bad signature")
            body = MSGPackSerializer.loads(payload)
            decision = Decision(str(body["action"]), str(body["reason"]), float(body["timestamp"]), signer)
            if body.get("prefix") != self.prefix:
                raise ValueError(f"record is for prefix {body.get('prefix')!r}")
            if decision.action not in (HALT, RESUME):
                raise ValueError(f"unknown action {decision.action!r}")
            if decision.timestamp > time.time() + MAX_CLOCK_SKEW:
                raise ValueError("timestamp in the future")
            return decision
        except (KeyError, TypeError, ValueError) as error:
            logger.warning("ignoring an invalid governance record: %s", error)
            return None

    def refresh(self, dht: DHT) -> Optional[Decision]:
        """Read every record under the governance key and adopt the newest valid one."""
        if not self.enabled:
            return None
        found = dht.get(governance_key(self.prefix), latest=True)
        if found is None or not isinstance(found.value, dict):
            return self.current
        for signer, item in sorted(found.value.items(), key=lambda kv: _timestamp_hint(kv[1].value)):
            self.consider(signer, item.value)
        return self.current


def _timestamp_hint(value: Any) -> float:
    """Sort records oldest first so the newest valid one is adopted last."""
    try:
        return float(MSGPackSerializer.loads(value["payload"])["timestamp"])
    except Exception:  # malformed records sort first and are then rejected by consider()
        return float("-inf")
