"""The DHT entries of swarm-hosted weights: published names, and the peers that serve a model id.

* ``swarm-weights:name:{name}@{publisher}``: a :class:`PublishedModel` (name -> model id, sizes) in the signed slot of
  its publisher's Ed25519 key (``publisher``: the key's id), written as adapter names are (``swarm.adapters.sharing``):
  only that key can write there, at any storing peer, so no flood of other keys can keep it out (issue 55). The same
  record also goes to the shared ``swarm-weights:name:{name}``, one slot per publisher, which lists who uses a name
  (``show NAME``) and is what readers before issue 55 read; it is bounded, so fresh keys can fill it, and a publish
  that only it refused still succeeds (it says so). A record signed by another key than its slot's is refused by
  storing peers and ignored by readers. Anyone may
  claim any name, so a reader follows only the publishers it trusts (:mod:`swarm.weights.trust`); two trusted
  publishers naming different ids make it ask for ``name@PUBLISHER`` (16 hex digits of the key's SHA-256, as
  for adapters). The sizes a record gives are hints (:mod:`swarm.weights.fetch`).
* ``swarm-weights:hosts:{model id}``: each serving peer's :class:`HostRecord` under its owner subkey (only its
  libp2p key can write it): where it listens, the manifest's size and which tensors it holds (a bitmap over the
  manifest's tensors; a server of the publisher's directory holds them all). These are the host's own claims:
  a fetcher holds a host only to them, never to another's.

The keys start with ``swarm-weights:``, which no model's DHT prefix can (prefixes are letters, digits, ``-_``).
Records are remote input even when signed: every field is checked and bounded.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht import DHT
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.adapters.block import is_sha256_hex
from swarm.adapters.sharing import AUTHOR_PATTERN, author_id, signed_entries, store_slot
from swarm.dht.keys import WEIGHTS_HOSTS, WEIGHTS_NAME, WEIGHTS_NAME_OWN
from swarm.dht.schema import (
    MAX_ADDRESS_CHARS,
    MAX_ADDRESSES,
    forget_local_copies,
    read_owned,
    store_owned,
)
from swarm.dht.validation import KeyPolicy, ed25519_text
from swarm.utils import fields
from swarm.utils.errors import EXIT_NOT_SERVED, EXIT_USAGE, SwarmError
from swarm.weights.limits import PUBLISH_LIFETIME
from swarm.weights.manifest import MAX_MANIFEST_BYTES, MAX_TENSORS, MODEL_NAME, Manifest
from swarm.weights.trust import PublisherTrust

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
MAX_HOSTS_READ = 64  # peers a fetcher considers for one model
MAX_HOSTS_KEPT = WEIGHTS_HOSTS.max_subkeys  # hosts records one storing peer keeps under a model's key
# a record with every field at its bound: 8 addresses of 256 characters, a bitmap of MAX_TENSORS bits, a signature
MAX_HOST_VALUE_BYTES = WEIGHTS_HOSTS.max_value_bytes
MAX_WEIGHTS_BYTES = 2**50
READ_BACK_SECONDS = 20.0  # how long a publish stores again and reads back before saying the record is unreadable


class WeightsError(SwarmError, ValueError):
    """A model named by swarm id or published name that cannot be had: no record, several publishers, a manifest
    that does not match."""

    exit_code = EXIT_USAGE


class WeightsNotReadable(WeightsError):
    """A published record that other peers do not return: nobody can read it, so it is not published."""

    exit_code = EXIT_NOT_SERVED


class WeightsNotServed(WeightsError):
    """No peer delivers a part of the model as its manifest says (none serves it, or every one that does failed)."""

    exit_code = EXIT_NOT_SERVED


def name_key(name: str) -> str:
    return WEIGHTS_NAME.key(name=name)


def own_name_key(name: str, publisher: str) -> str:
    """Where only the key with id ``publisher`` (16 hex digits) writes its record for ``name``."""
    return WEIGHTS_NAME_OWN.key(name=name, signer=publisher)


def hosts_key(model_id: str) -> str:
    return WEIGHTS_HOSTS.key(sha256=model_id)


def parse_reference(reference: str) -> tuple[str, Optional[str]]:
    """``name`` or ``name@PUBLISHER`` -> (name, publisher id or None); :class:`WeightsError` when malformed."""
    name, _, publisher = reference.partition("@")
    if not MODEL_NAME.fullmatch(name) or (publisher and not AUTHOR_PATTERN.fullmatch(publisher)):
        raise WeightsError(f"{reference!r} is no published model name: NAME (1-64 letters, digits, '_.-') or "
                           f"NAME@PUBLISHER (16 hex digits, as `python -m swarm.weights show NAME` lists)")
    return name, publisher or None


# ----- published names -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PublishedModel:
    """A name a publisher gave a model id, with sizes a fetcher checks before fetching anything."""

    name: str
    model_id: str
    manifest_bytes: int
    weights_bytes: int
    published: float = 0.0  # the publisher's clock, seconds since the epoch
    publisher: str = ""  # the signing key (base64), filled in from the slot when read

    @classmethod
    def of(cls, name: str, manifest: Manifest) -> "PublishedModel":
        """The record that names ``manifest``'s model ``name``, published now (its sizes from the manifest)."""
        return cls(name, manifest.model_id, len(manifest.to_bytes()), manifest.weights_bytes, time.time())

    @property
    def publisher_id(self) -> str:
        return author_id(self.publisher)

    def payload(self) -> bytes:
        return MSGPackSerializer.dumps({"record_version": RECORD_VERSION, "name": self.name, "model_id": self.model_id,
                                        "manifest_bytes": self.manifest_bytes, "weights_bytes": self.weights_bytes,
                                        "published": self.published})

    @classmethod
    def from_payload(cls, payload: bytes, publisher: str) -> "PublishedModel":
        """Parse a verified payload; ValueError for anything malformed."""
        try:
            value = MSGPackSerializer.loads(payload)
        except Exception as error:  # msgpack raises many types on junk
            raise ValueError(f"not msgpack: {type(error).__name__}") from None
        if not isinstance(value, dict) or value.get("record_version") != RECORD_VERSION:
            raise ValueError("unknown weights record version")
        name, model_id = value.get("name"), value.get("model_id")
        if not isinstance(name, str) or not MODEL_NAME.fullmatch(name) or not is_sha256_hex(model_id):
            raise ValueError("a weights record names a model (NAME) and its id (64 hex digits)")
        return cls(name, model_id, fields.integer(value.get("manifest_bytes"), 1, MAX_MANIFEST_BYTES),
                   fields.integer(value.get("weights_bytes"), 0, MAX_WEIGHTS_BYTES),
                   fields.number(value.get("published", 0.0), 0.0, 1e11), publisher)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "publisher": self.publisher_id, "model_id": self.model_id,
                "manifest_bytes": self.manifest_bytes, "weights_bytes": self.weights_bytes,
                "published": self.published}


def read_published(dht: DHT, name: str, publishers: Iterable[str] = ()) -> list[PublishedModel]:
    """Every record for ``name`` whose signature by its slot's key holds, one per publisher (its newest): those of
    ``publishers`` (ids, 16 hex digits) under their own keys, which nobody else can fill, and those the shared name key
    lists. One read."""
    own = {own_name_key(name, publisher): publisher for publisher in publishers}
    records: dict[str, PublishedModel] = {}
    for signer, payload in signed_entries(dht, name_key(name), own):
        try:
            record = PublishedModel.from_payload(payload, signer)
        except Exception as error:  # remote input: whatever went wrong, it is not a record
            logger.debug("ignoring a malformed weights record under %r: %s", name, str(error)[:200])
            continue
        held = records.get(signer)
        if record.name == name and (held is None or record.published > held.published):  # the DHT key is signed
            records[signer] = record  # too: a record cannot be moved to another name
    return list(records.values())


def reference_publishers(publisher: Optional[str], trust: PublisherTrust) -> list[str]:
    """The publisher ids whose own keys a reader of ``NAME`` or ``NAME@PUBLISHER`` reads: the one named, else those it
    trusts (a reader who names nobody and trusts nobody reads the shared list alone)."""
    if publisher is not None:
        return [publisher]
    return sorted(author_id(key) for key in trust.keys) if trust.names else []


def choose_published(records: list[PublishedModel], reference: str, trust: PublisherTrust) -> PublishedModel:
    """The one record ``name`` or ``name@PUBLISHER`` names among the publishers ``trust`` follows (or the one the
    reference names); a clear error for none, for names turned off, or for trusted publishers that disagree."""
    name, publisher = parse_reference(reference)
    if not trust.names:
        raise WeightsError(f"model {reference!r}: names are not resolved here ({trust.source}): name the model by "
                           f"its id (64 hex digits)")
    if publisher is not None:
        records = [r for r in records if r.publisher_id == publisher]
        if not records:
            raise WeightsError(f"model {reference!r} is no directory here, and no model is published under {name!r} "
                               f"by publisher {publisher} (records not signed by their slot's key are ignored; "
                               f"`python -m swarm.weights show {name}` lists what is)")
        return records[0]
    if not trust.keys:
        raise WeightsError(f"model {reference!r}: a name resolves only through publishers you trust, and none is "
                           f"configured: pass --trusted-publishers KEY (or set $SWARM_GOVERNANCE_KEYS), name the "
                           f"publisher ({name}@PUBLISHER, as `python -m swarm.weights show {name}` lists), or the id")
    trusted = [r for r in records if trust.trusts(r.publisher)]
    if not trusted:
        ignored = f" ({len(records)} records by publishers you do not trust are ignored)" if records else ""
        raise WeightsError(f"model {reference!r} is no directory here, and no publisher you trust ({trust.source}) "
                           f"published {name!r}{ignored}: `python -m swarm.weights show {name}` lists what is")
    if len({r.model_id for r in trusted}) > 1:
        choices = ", ".join(sorted(f"{r.name}@{r.publisher_id} (model {r.model_id[:12]}...)" for r in trusted))
        raise WeightsError(f"several publishers you trust claim the model name {name!r} for different models: "
                           f"choose one of {choices}")
    return max(trusted, key=lambda r: r.published)


def publish(dht: DHT, key: Ed25519PrivateKey, record: PublishedModel, lifetime: float = PUBLISH_LIFETIME,
            read_back_seconds: float = READ_BACK_SECONDS) -> PublishedModel:
    """Sign and store ``record`` in the publisher's slot under its own name key (and the shared one, which lists the
    name's publishers); the record as *other* peers return it from the publisher's own key (this peer's own copies are
    dropped before each read: a record only this peer holds is not published), or :class:`WeightsError` saying it is
    not readable. A shared key that did not keep it (full of other keys' slots) is said in a warning."""
    own = ed25519_text(key)
    keys = [own_name_key(record.name, author_id(own)), name_key(record.name)]
    deadline = time.monotonic() + read_back_seconds
    stored = False
    for attempt in itertools.count():  # a peer that has just joined may not reach the key's holders at once
        expiration = get_dht_time() + lifetime
        stored = store_slot(dht, key, keys[0], record.payload(), expiration) or stored
        store_slot(dht, key, keys[1], record.payload(), expiration)
        forget_local_copies(dht, keys)
        found = [r for r in read_published(dht, record.name, [author_id(own)]) if r.publisher == own
                 and r.model_id == record.model_id]
        if found:
            if not any(r.publisher == own for r in read_published(dht, record.name)):
                logger.warning("published %s under your own key; the shared list of its publishers is full, so readers "
                               "who neither trust you nor name %s@%s do not see it", record.name, record.name,
                               author_id(own))
            return found[0]
        pause = min(0.5 * 2**attempt, 4.0)
        if time.monotonic() + pause >= deadline:
            break
        time.sleep(pause)
    raise WeightsNotReadable(f"the record for {record.name!r} was {'stored' if stored else 'refused'} but other peers "
                             f"do not return it: it is not readable, so it is not published (its key may be flooded; "
                             f"try again later or under another name)")


# ----- hosts -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostRecord:
    """A peer serving a model id: where it listens, the size of the manifest (so that a fetcher given only the
    id knows how much to ask for) and which tensors it holds (None: all of them)."""

    peer_id: str
    addresses: tuple[str, ...]
    manifest_bytes: int
    tensors: Optional[frozenset[int]] = None

    def holds(self, index: int) -> bool:
        return self.tensors is None or index in self.tensors

    def to_value(self) -> dict[str, Any]:
        bitmap = None
        if self.tensors is not None:
            bits = bytearray(-(-(max(self.tensors, default=-1) + 1) // 8))
            for index in self.tensors:
                bits[index // 8] |= 1 << (index % 8)
            bitmap = bytes(bits)
        return {"record_version": RECORD_VERSION, "addresses": list(self.addresses[:MAX_ADDRESSES]),
                "manifest_bytes": self.manifest_bytes, "tensors": bitmap}

    @classmethod
    def from_value(cls, peer_id: str, value: Any) -> "HostRecord":
        """Parse a stored value; ValueError for anything malformed."""
        if not isinstance(value, dict) or value.get("record_version") != RECORD_VERSION:
            raise ValueError("unknown hosts record version")
        addresses = tuple(fields.texts(value.get("addresses", []), MAX_ADDRESSES, MAX_ADDRESS_CHARS))
        manifest_bytes = fields.integer(value.get("manifest_bytes"), 1, MAX_MANIFEST_BYTES)
        bitmap = value.get("tensors")
        if bitmap is None:
            return cls(peer_id, addresses, manifest_bytes)
        if not isinstance(bitmap, bytes) or len(bitmap) > -(-MAX_TENSORS // 8):
            raise ValueError("tensors must be a bitmap of at most one bit per tensor")
        held = frozenset(i for i in range(len(bitmap) * 8) if bitmap[i // 8] >> (i % 8) & 1)
        return cls(peer_id, addresses, manifest_bytes, held)


def hosts_policy(model_id: str) -> KeyPolicy:
    """What a peer that knows ``model_id`` keeps under its hosts key (``swarm.dht.keys.WEIGHTS_HOSTS``): records of
    proven peer ids, sent by those peers, each at most :data:`MAX_HOST_VALUE_BYTES`, :data:`MAX_HOSTS_KEPT` of them,
    expiring within the hour."""
    return WEIGHTS_HOSTS.policy(hosts_key(model_id))


def declare_host(dht: DHT, model_id: str, record: HostRecord, subkey: bytes, expiration: float, wait: bool = True):
    """Announce that this peer serves ``model_id`` (a future of the store when ``wait`` is false)."""
    return store_owned(dht, [hosts_key(model_id)], subkey, [record.to_value()], expiration, wait)


def read_hosts(dht: DHT, model_id: str) -> list[HostRecord]:
    """Peers that provably announced serving ``model_id`` (at most :data:`MAX_HOSTS_READ`)."""
    hosts = []
    for _, peer_id, value in read_owned(dht, [hosts_key(model_id)]):
        try:
            hosts.append(HostRecord.from_value(peer_id, value))
        except Exception as error:  # remote input
            logger.debug("ignoring a malformed hosts record of %s: %s", peer_id, str(error)[:200])
        if len(hosts) >= MAX_HOSTS_READ:
            break
    return hosts
