"""DHT record validators that every swarm process runs, so honest peers never store a record nobody can vouch for.

Two kinds of protected subkeys (hivemind validates only the subkey and the value: the key is a hash):

* ``{peer id}[owner:ssh-rsa ...]``: a record that speaks for a peer. hivemind's ``RSASignatureValidator``
  checks that the owner key signed it; :class:`OwnerBindingValidator` checks that the owner key *is* that
  peer's libp2p identity (the peer id derives from it). Readers apply the same rule (:func:`owner_peer_id`).
* ``[ed25519:BASE64]``: a signed slot, one per Ed25519 key (governance decisions). :class:`SignedSlotValidator`
  accepts a write only with a signature by that key over the DHT key, the payload and the expiration time, so
  nobody can squat the slot with junk or replay a signed value with a later expiration.

Subkeys without either tag are left alone on keys the swarm does not use (hivemind's own features, such as the averager
of ``swarm.finetune.together``, use plain subkeys). On the keys the swarm reads (each declared with its
:class:`KeyPolicy` in ``swarm.dht.keys``) a process refuses to store what no reader would use: plain subkeys, values
over a size bound, more than a bounded number of subkeys per key (:class:`ProtectedStorage`). It knows a key's policy
in advance (its model's keys, ``swarm.dht.schema.protected_keys``) or from the first value naming the key: every value
the swarm stores carries its key's name (:func:`describe`), since validators and storage see only the key's hash. A DHT
get returns a key's whole dictionary in one reply, and a reply over libp2p's 4 MiB message limit is lost together with
the peers it names: every swarm peer therefore keeps every key, known or not, within :data:`MAX_KEY_BYTES` and
:data:`MAX_KEY_SUBKEYS`, so that no flood makes its replies unreadable (a bootstrap peer that knows no prefix
included); the policies' bounds are tighter still.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import re
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.dht.identity import peer_id_from_owner_key
from swarm.dht.stamp import STAMP_FIELD, stamp_refusal

logger = logging.getLogger(__name__)

OWNER_MARK = "[owner:"
SLOT_MARK = "[ed25519:"
_OWNED_SUBKEY = re.compile(rb"([1-9A-HJ-NP-Za-km-z]+)\[owner:(ssh-rsa [A-Za-z0-9+/=]+)\]")
_SLOT_SUBKEY = re.compile(r"\[ed25519:([A-Za-z0-9+/=]{44})\]")
_SLOT_DOMAIN = b"swarm-signed-slot-v1"
MAX_SLOT_PAYLOAD = 16 * 1024

# What one key may hold at a swarm peer, all entries together. One find request asks for up to hivemind's
# ``chunk_size`` (16) keys and its reply carries them whole beside up to 20 peers per key; with every key at the bound
# the reply stays below libp2p's 4 MiB message limit with half a MiB to spare.
MESSAGE_LIMIT_BYTES = 4 * 1024 * 1024
KEYS_PER_FIND = 16
MAX_KEY_BYTES = (MESSAGE_LIMIT_BYTES - 512 * 1024) // KEYS_PER_FIND  # 224 KiB
MAX_KEY_SUBKEYS = 1024  # also keeps the size check of each store cheap
MAX_READ_KEYS = 4096  # keys whose policy a reader keeps from its reads (least recently read dropped: learnt again)
HELD_POLICY = "swarm_policy"  # the attribute of a held dictionary naming the policy learnt from its values
ENTRY_OVERHEAD_BYTES = 16  # an entry's expiration and msgpack framing in a reply


def subkey_bytes(subkey: Any) -> Optional[bytes]:
    """A subkey as bytes (servers write bytes, hivemind may hand back str); None for other types."""
    if isinstance(subkey, bytes):
        return subkey
    if isinstance(subkey, str):
        return subkey.encode("utf-8", errors="replace")
    return None


def owner_peer_id(subkey: Any) -> Optional[str]:
    """The peer id a subkey speaks for, if its owner key proves it; None for anything else.

    Only ``{peer id}[owner:KEY]`` exactly, where KEY is an RSA key whose libp2p peer id is that peer id: an
    untagged subkey, another peer's id in front of one's own key, or a malformed tag all give None.
    """
    raw = subkey_bytes(subkey)
    match = _OWNED_SUBKEY.fullmatch(raw) if raw is not None else None
    if match is None:
        return None
    claimed = match.group(1).decode()
    return claimed if peer_id_from_owner_key(match.group(2)) == claimed else None


def _load_subkey(record: DHTRecord) -> Any:
    try:
        return MSGPackSerializer.loads(record.subkey)
    except Exception:  # any bytes can arrive from the network; msgpack raises many types
        return None


class OwnerBindingValidator(RecordValidatorBase):
    """Refuses ``{peer id}[owner:KEY]`` subkeys whose KEY does not derive that peer id.

    An owner tag with nothing before it (hivemind's own protected records) is left to the signature check.
    """

    def validate(self, record: DHTRecord) -> bool:
        if OWNER_MARK.encode() not in record.subkey:
            return True
        raw = subkey_bytes(_load_subkey(record))
        if raw is None:
            return False
        if raw.startswith(OWNER_MARK.encode()):
            return True
        if owner_peer_id(raw) is None:
            logger.debug("refusing a record whose owner key does not prove its peer id: %r", raw[:80])
            return False
        return True

    @property
    def priority(self) -> int:
        return 5  # after the signature check (10): a forged signature is refused first

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, OwnerBindingValidator)  # one instance is enough


# ----- signed slots ------------------------------------------------------------------------------------
def ed25519_public_key(text: str) -> Ed25519PublicKey:
    """An Ed25519 public key from its base64 text (32 raw bytes); ValueError otherwise."""
    try:
        return Ed25519PublicKey.from_public_bytes(base64.b64decode(text.strip(), validate=True))
    except (ValueError, TypeError, binascii.Error) as error:
        raise ValueError(f"not an Ed25519 public key (base64): {text[:60]!r}") from error


def ed25519_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return base64.b64encode(public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)).decode()


def signer_id(public_key_text: str) -> str:
    """16 hex digits naming an Ed25519 key (sha256 of its raw bytes): short enough to type after ``NAME@``, and the
    part of a key that only this key may write under (``swarm.dht.keys``); ValueError for a text that is no key."""
    return hashlib.sha256(ed25519_public_key(public_key_text).public_bytes_raw()).hexdigest()[:16]


def slot_subkey(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The one subkey an Ed25519 key may write under."""
    return f"{SLOT_MARK}{ed25519_text(key)}]"


def slot_signer(subkey: Any) -> Optional[str]:
    """The base64 key a slot subkey names, or None if it is not a slot subkey."""
    raw = subkey_bytes(subkey)
    match = _SLOT_SUBKEY.fullmatch(raw.decode("utf-8", errors="replace")) if raw is not None else None
    return match.group(1) if match else None


def _signed_bytes(key_id: bytes, payload: bytes, expiration: float) -> bytes:
    return MSGPackSerializer.dumps([_SLOT_DOMAIN, key_id, payload, float(expiration)])


def dht_key_id(key: Any) -> bytes:
    """What hivemind validators see as a record's key: the hash of the DHT key."""
    return DHTID.generate(source=key).to_bytes()


def sign_slot(key: Ed25519PrivateKey, dht_key: Any, payload: bytes, expiration: float) -> dict[str, bytes]:
    """The value to store under ``slot_subkey(key)`` at ``dht_key`` with exactly this ``expiration``."""
    if len(payload) > MAX_SLOT_PAYLOAD:
        raise ValueError(f"slot payload of {len(payload)} bytes exceeds {MAX_SLOT_PAYLOAD}")
    if RSASignatureValidator.SIGNATURE_FORMAT.split(b"_value_")[0] in payload:
        raise ValueError("the payload must not contain '[signature:' (hivemind strips it from stored values)")
    value = {"payload": payload, "signature": key.sign(_signed_bytes(dht_key_id(dht_key), payload, expiration))}
    return describe(dht_key, value) if isinstance(dht_key, str) else value


def verify_slot(key_id: bytes, subkey: Any, value: Any, expiration: float) -> bytes:
    """The payload of a signed slot value; ValueError saying why if the signature does not hold."""
    signer = slot_signer(subkey)
    if signer is None:
        raise ValueError("not a signed-slot subkey")
    if not isinstance(value, dict) or not isinstance(value.get("payload"), bytes) \
            or not isinstance(value.get("signature"), bytes):
        raise ValueError("a signed slot holds {'payload': bytes, 'signature': bytes}")
    payload = value["payload"]
    if len(payload) > MAX_SLOT_PAYLOAD:
        raise ValueError(f"payload of {len(payload)} bytes exceeds {MAX_SLOT_PAYLOAD}")
    try:
        ed25519_public_key(signer).verify(value["signature"], _signed_bytes(key_id, payload, expiration))
    except InvalidSignature:
        raise ValueError("the signature does not match the slot's key, payload and expiration") from None
    return payload


class SignedSlotValidator(RecordValidatorBase):
    """Refuses a write under ``[ed25519:KEY]`` unless KEY signed this key, payload and expiration time."""

    def validate(self, record: DHTRecord) -> bool:
        if SLOT_MARK.encode() not in record.subkey:
            return True
        try:
            value = MSGPackSerializer.loads(record.value)
            verify_slot(record.key, _load_subkey(record), value, record.expiration_time)
            return True
        except Exception as error:  # junk from the network: any parse error means "refuse"
            logger.debug("refusing a signed-slot record: %s", error)
            return False

    @property
    def priority(self) -> int:
        return 5

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SignedSlotValidator)


# ----- values that name their key -------------------------------------------------------------------------
KEY_FIELD = "dht_key"  # the field of every value the swarm stores that names the key it is stored under
_RSA_SIGNATURE = re.compile(re.escape(RSASignatureValidator.SIGNATURE_FORMAT).replace(b"_value_", rb"(.+?)"))


def describe(dht_key: str, value: dict) -> dict:
    """``value`` naming ``dht_key``, so that a storing peer, which sees only the key's hash, knows which key (and so
    which policy, ``swarm.dht.keys``) it is stored under."""
    return {**value, KEY_FIELD: dht_key}


def stored_map(stored: bytes) -> Optional[dict]:
    """A stored value as the map the swarm stores (its hivemind RSA signature stripped), or None for anything else."""
    try:
        value = MSGPackSerializer.loads(_RSA_SIGNATURE.sub(b"", stored))
    except Exception:  # any bytes arrive from the network; msgpack raises many types
        return None
    return value if isinstance(value, dict) else None


def described_key(stored: bytes) -> Optional[str]:
    """The key a stored value names (its hivemind RSA signature stripped), or None for a value that names none."""
    value = stored_map(stored)
    named = value.get(KEY_FIELD) if value is not None else None
    return named if isinstance(named, str) and len(named) <= MAX_KEY_NAME_CHARS else None


MAX_KEY_NAME_CHARS = 256


# ----- keys the swarm reads: what they may hold -------------------------------------------------------
OWNED, SLOT = "owned", "slot"


@dataclass(frozen=True)
class KeyPolicy:
    """What one DHT key the swarm reads may hold: only ``kind`` subkeys (``owned`` records of a proven peer id,
    or ``slot`` entries of Ed25519 keys, only of ``signers`` when given), each value at most ``max_value_bytes``
    (as stored, signature included), at most ``max_subkeys`` subkeys at one storing peer."""

    name: str  # the DHT key itself, for log lines (validators only see its hash)
    kind: str
    max_value_bytes: int
    max_subkeys: int
    signers: Optional[frozenset[str]] = None
    max_lifetime: Optional[float] = None  # seconds from now an entry may expire at (None: any)
    trusted: frozenset[str] = frozenset()  # slot keys that get room when the key is full (newest other slot dropped)
    max_subkey_bytes: int = 1024
    signer_id: Optional[str] = None  # the id (signer_id) of the one key whose slot the key takes, when it names one
    stamp_bits: int = 0  # the work a new slot's stamp proves (swarm.dht.stamp): shared lists anyone may write

    def refusal(self, subkey: Any, value_size: int, sender: Optional[str] = None) -> Optional[str]:
        """Why an entry may not be stored under this key, or None if it may. ``sender``: the peer whose store
        request brought it (None for this process's own writes and reads)."""
        if value_size > self.max_value_bytes:
            return f"a value of {value_size} bytes (at most {self.max_value_bytes})"
        raw = subkey_bytes(subkey)
        if raw is None or len(raw) > self.max_subkey_bytes:
            return f"a subkey that is no text of at most {self.max_subkey_bytes} bytes"
        if self.kind == OWNED:
            owner = owner_peer_id(subkey)
            if owner is None:
                return "a subkey that proves no peer id"
            if sender is not None and sender != owner:
                return f"a record of peer {owner} sent by another peer ({sender})"
            return None
        signer = slot_signer(subkey)
        if signer is None:
            return "a subkey that is no signed slot"
        if self.signers is not None and signer not in self.signers:
            return "a slot of a key no process here trusts"
        if self.signer_id is not None and signer_id(signer) != self.signer_id:
            return f"a slot of a key other than the one the key names ({self.signer_id})"
        return None

    def work_refusal(self, key_id: bytes, subkey: Any, stored: bytes) -> Optional[str]:
        """Why a slot's value does not carry the work this key asks of a new entry (:mod:`swarm.dht.stamp`), or
        None. O(1): one msgpack parse and one sha256."""
        if self.stamp_bits <= 0:
            return None
        value = stored_map(stored)
        return stamp_refusal(key_id, slot_signer(subkey) or "", value.get(STAMP_FIELD) if value else None,
                             self.stamp_bits)

    def prefers(self, subkey: Any) -> bool:
        """Whether the entry is a slot of a trusted key (room is made for it when the key is full)."""
        return bool(self.trusted) and slot_signer(subkey) in self.trusted


# The peer whose DHT store request is being served (set by ``swarm.dht.node`` around hivemind's handler; None for
# this process's own writes). Owned records are taken only from their owner: one peer holding many free peer ids
# could otherwise fill a block key's bounded subkeys with records of made-up servers and keep real ones out.
STORE_SENDER: ContextVar[Optional[str]] = ContextVar("swarm_dht_store_sender", default=None)


class ProtectedStorage(DHTLocalStorage):
    """A peer's local storage that keeps every key small enough to be read, and under the swarm's keys only what
    their :class:`KeyPolicy` allows.

    Every key, known or not: a regular value or a dictionary of at most :data:`MAX_KEY_BYTES` (entries with their
    subkeys) and :data:`MAX_KEY_SUBKEYS` subkeys; a store past either is refused, updates of a held subkey within
    them pass. So a flood costs readers at most the room it takes, never the peer's answer.

    A key's policy is known in advance (``policies``: the keys of the prefixes this process serves, by hash), learnt
    by reading (``learn``: a reader knows the keys it reads) or learnt from the first value that names a key of a
    declared family (``resolve``, ``swarm.dht.keys.policy_for``; :func:`described_key`): names and digests are computed
    by readers, so a storing peer cannot list those keys, but every value the swarm stores names its key. Once a key's
    policy is known, whatever it held that the policy does not allow is dropped (a flood stored while the key looked
    like anybody's, a regular value that would block every subkey), and a value that names no key or another key is
    refused there.

    A policy learnt from a value is kept *with the key's entries* (an attribute of the held dictionary), not in a table
    of its own: it lives exactly as long as what it protects, takes no room a flood could fill, and is found in O(1).
    (A bounded table of learnt keys overflowed: past it a key was forgotten after its store, and one regular value
    with a year's expiry then hid it.) Keys learnt by reading are kept in a bounded table, least recently read
    dropped first: a reader learns each key again before every read, so dropping one forgets nothing it relies on.
    No store scans more than the one key it writes (at most :data:`MAX_KEY_SUBKEYS` entries).

    A check at storage rather than a record validator: validators also run on every reply a reader gets, and
    hivemind then drops a peer's whole answer for a key when one entry fails, so one junk entry on a peer that
    knows nothing of the swarm's keys (a bootstrap peer) would hide that peer's honest records from readers too.
    Here only writes are refused: plain subkeys, values that do not name their key, oversized values, owned records
    sent by a peer other than their owner (:data:`STORE_SENDER`) or expiring later than the policy allows, a whole
    (regular) value replacing the key's dictionary or naming a swarm key, and a new subkey under a key already holding
    its maximum (updates of a held subkey pass; a slot of a trusted key takes the place of the newest slot of an
    untrusted one). Installed on a running node by :func:`protect_storage` (the class of its storages is swapped in
    place).
    """

    policies: dict[bytes, KeyPolicy]
    reading: "OrderedDict[bytes, KeyPolicy]"
    resolve: Optional[Callable[[str], Optional[KeyPolicy]]]

    def store(self, key: DHTID, value: bytes, expiration_time: float, subkey: Any = None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        policy = self.policy_of(key.to_bytes())
        if policy is not None:
            return self._refuse(policy.name, "a regular value (it would replace every record)")
        if isinstance(value, bytes):
            named = described_key(value)
            if named is not None and self.resolve is not None and self.resolve(named) is not None:
                return self._refuse(key, f"a regular value naming the swarm's key {named[:80]!r}")
            if len(value) > MAX_KEY_BYTES:
                return self._refuse(key, f"a value of {len(value)} bytes (at most {MAX_KEY_BYTES} per key)")
        return super().store(key, value, expiration_time)

    def store_subkey(self, key: DHTID, subkey: Any, value: bytes, expiration_time: float) -> bool:
        named = described_key(value)
        if named is not None and dht_key_id(named) != key.to_bytes():
            return self._refuse(key, f"a value naming another key ({named[:80]!r})")
        policy = self._policy(key, named)
        if policy is not None:
            reason = (("a value that does not name its key" if named is None else None)
                      or policy.refusal(subkey, len(value), STORE_SENDER.get())
                      or policy.work_refusal(key.to_bytes(), subkey, value)
                      or self._too_late(expiration_time, policy) or self._make_room(key, subkey, policy))
            if reason is not None:
                return self._refuse(policy.name, reason)
        reason = self._over_key_bound(key, subkey, value)
        if reason is not None:
            return self._refuse(policy.name if policy is not None else key, reason)
        stored = super().store_subkey(key, subkey, value, expiration_time)
        held = self._held_dictionary(key)
        if policy is not None and held is not None:
            setattr(held, HELD_POLICY, policy)  # the policy lives as long as the entries it protects
        return stored

    def policy_of(self, key_id: bytes) -> Optional[KeyPolicy]:
        """The policy of a key (by hash) known here: listed, read, or kept with its entries; None for a key that looks
        like anybody's. O(1)."""
        policy = self.policies.get(key_id) or self.reading.get(key_id)
        if policy is not None:
            return policy
        held = self.data.get(DHTID.from_bytes(key_id))  # no expiry sweep: an expired dictionary still names its key
        return getattr(held.value, HELD_POLICY, None) if held is not None else None

    def learn(self, key: str) -> Optional[KeyPolicy]:
        """Learn the policy of ``key``, which this process is about to read (a reader knows the keys it reads): what
        the key holds against it is dropped, and replies of other peers are filtered by it (``swarm.dht.node``)."""
        key_id = DHTID.generate(source=key)
        policy = self._policy(key_id, key)
        if policy is not None and key_id.to_bytes() not in self.policies:
            self.reading[key_id.to_bytes()] = policy
            self.reading.move_to_end(key_id.to_bytes())
            while len(self.reading) > MAX_READ_KEYS:
                self.reading.popitem(last=False)  # learnt again before its next read
        return policy

    def _policy(self, key: DHTID, named: Optional[str]) -> Optional[KeyPolicy]:
        """The key's policy: known, or learnt now from the key this value names (then what the key held against it is
        dropped). A value naming a key of no family under an unknown key has none."""
        policy = self.policy_of(key.to_bytes())
        if policy is not None or named is None or self.resolve is None:
            return policy
        policy = self.resolve(named)
        if policy is not None:
            self._drop_disallowed(key, policy)
        return policy

    def _drop_disallowed(self, key: DHTID, policy: KeyPolicy) -> None:
        """Drop what ``key`` holds that ``policy`` does not allow, then its newest entries past the policy's count
        (slots of untrusted keys first); the dictionary left keeps the policy."""
        current = self.get(key)
        if current is None:
            return
        if not isinstance(current.value, DictionaryDHTValue):
            del self[key]
            logger.debug("dropped a regular value held under %s", policy.name)
            return
        held = current.value
        setattr(held, HELD_POLICY, policy)
        dropped = [subkey for subkey, item in held.items()
                   if described_key(item.value) != policy.name or policy.refusal(subkey, len(item.value)) is not None
                   or policy.work_refusal(key.to_bytes(), subkey, item.value) is not None]
        for subkey in dropped:
            del held[subkey]
        while len(held) > policy.max_subkeys:
            newest = self._newest_untrusted(held, policy)
            del held[newest if newest is not None else _subkeys(held)[-1]]
            dropped.append(None)
        if dropped:
            logger.debug("dropped %d entries held under %s that its policy does not allow", len(dropped), policy.name)

    @staticmethod
    def _newest_untrusted(held: DictionaryDHTValue, policy: KeyPolicy) -> Any:
        """The subkey of the newest entry whose slot is not a trusted key's, or None."""
        return next((subkey for subkey in reversed(_subkeys(held)) if not policy.prefers(subkey)), None)

    @staticmethod
    def _too_late(expiration_time: float, policy: KeyPolicy) -> Optional[str]:
        """Entries that would outlive their writer by far (a squatter that leaves its records for a month)."""
        if policy.max_lifetime is None or expiration_time <= get_dht_time() + policy.max_lifetime:
            return None
        return f"an expiration {expiration_time - get_dht_time():.0f} s ahead (at most {policy.max_lifetime:.0f})"

    def _make_room(self, key: DHTID, subkey: Any, policy: KeyPolicy) -> Optional[str]:
        """None if the entry fits under the policy's count (room made for a trusted slot), else why not."""
        current = self._held_dictionary(key)
        if current is None or subkey in current or len(current) < policy.max_subkeys:
            return None
        if policy.prefers(subkey):
            untrusted = self._newest_untrusted(current, policy)
            if untrusted is not None:
                del current[untrusted]
                logger.debug("dropped an untrusted slot under %s for a trusted one", policy.name)
                return None
        return f"a subkey beyond the {policy.max_subkeys} held"

    def _over_key_bound(self, key: DHTID, subkey: Any, value: bytes) -> Optional[str]:
        """Why storing this entry would take the key past what one reply carries readably, or None."""
        current = self._held_dictionary(key)
        if current is None:
            return None if entry_bytes(subkey, value) <= MAX_KEY_BYTES else f"an entry over {MAX_KEY_BYTES} bytes"
        if subkey not in current and len(current) >= MAX_KEY_SUBKEYS:
            return f"a subkey beyond the {MAX_KEY_SUBKEYS} any key holds"
        total = entry_bytes(subkey, value) + sum(entry_bytes(held, item.value) for held, item in current.items()
                                                 if held != subkey)
        return f"{total} bytes under one key (at most {MAX_KEY_BYTES})" if total > MAX_KEY_BYTES else None

    def _held_dictionary(self, key: DHTID) -> Optional[DictionaryDHTValue]:
        current = self.get(key)
        return current.value if current is not None and isinstance(current.value, DictionaryDHTValue) else None

    @staticmethod
    def _refuse(name: Any, reason: str) -> bool:
        logger.debug("refusing %s under %s", reason, name)
        return False


def _subkeys(held: DictionaryDHTValue) -> list[Any]:
    """A key's subkeys, oldest first (hivemind keeps them in the order they came; an update keeps its place)."""
    return [subkey for subkey, _ in held.items()]


def entry_bytes(subkey: Any, value: bytes) -> int:
    """What one dictionary entry adds to a reply carrying its key."""
    raw = subkey_bytes(subkey)
    size = len(raw) if raw is not None else len(MSGPackSerializer.dumps(subkey))
    return size + len(value) + ENTRY_OVERHEAD_BYTES


def protect_storage(storages: list[DHTLocalStorage], policies: Mapping[bytes, KeyPolicy],
                    resolve: Optional[Callable[[str], Optional[KeyPolicy]]] = None) -> None:
    """Make each storage a :class:`ProtectedStorage` with ``policies`` (by key hash; none still bounds every key) and
    ``resolve`` (a key's policy from the key a value names: ``swarm.dht.keys.policy_for``)."""
    for storage in storages:
        storage.__class__ = ProtectedStorage
        storage.policies = dict(policies)
        storage.reading = OrderedDict()
        storage.resolve = resolve


def swarm_validators() -> list[RecordValidatorBase]:
    """The validators every swarm process registers (with hivemind's ``RSASignatureValidator``)."""
    return [OwnerBindingValidator(), SignedSlotValidator()]
