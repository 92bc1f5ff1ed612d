"""DHT keys and records: what a server announces and how clients read it.

One key per block, ``{prefix}.{block}``; the subkey is the server's peer id followed by its RSA owner tag
(``[owner:ssh-rsa …]``), whose key is the server's libp2p identity. hivemind's ``RSASignatureValidator`` only
accepts writes signed by that key, and ``swarm.dht.validation`` only those whose key derives the peer id in
front of it; readers here apply the same rule (:func:`swarm.dht.validation.owner_peer_id`) and ignore every other entry.
Experts announce under one key, ``{prefix}.experts``, the same way: each server's entry lists its
:class:`ExpertRecord` s (at most :data:`MAX_EXPERTS_PER_SERVER`, with the compatibility tag), so a reader finds every
domain in one read of one key that every server protects (a key per domain could not be protected: the DHT only
shows peers the hash of a key, and domain names are open-ended).

Every key is declared in ``swarm.dht.keys`` with what it may hold; every value stored here names its key, so storing
peers apply that policy (``swarm.dht.validation``) even to keys they cannot list, and :func:`protected_keys` lists the
model's keys a process knows in advance. All reads of the swarm's keys go through :func:`read_entries`.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import re
from dataclasses import dataclass, field
from functools import partial  # picklable: run_coroutine ships it to the DHT process
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from hivemind.dht import DHT, DHTNode
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from swarm.dht.compatibility import CompatibilityTag
from swarm.dht.config import MAX_AUDIT_LIFETIME, MAX_BLOCKS, MAX_OWNED_LIFETIME  # noqa: F401 (lifetimes read from here)
from swarm.dht.keys import (
    ADAPTER_INDEX,
    ADAPTER_VERSIONS,
    AUDIT,
    BLOCK,
    EXPERTS,
    GOVERNANCE,
    GOVERNANCE_OWN,
    STREAMS,
    family_of,
)
from swarm.dht.validation import KeyPolicy, ProtectedStorage, describe, owner_peer_id, signer_id
from swarm.utils import fields

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
MAX_NUMERICS_CHARS = 120  # a record's numerics text is shown in health maps and results: bounded


class ServerState(enum.IntEnum):
    OFFLINE = 0
    JOINING = 1
    ONLINE = 2


@dataclass
class ServerRecord:
    """A server's announcement; the same record is stored under every block key of its span."""

    peer_id: str
    state: ServerState
    start: int
    end: int
    throughput: float  # tokens per second through the whole span
    public_name: Optional[str] = None
    version: str = ""
    cache_tokens_left: int = 0
    experts: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # "exact" when the span computes in the checkpoint's dtype, unquantized; otherwise what differs (another
    # dtype, int8 weights): clients route through it only when the user allows approximate servers.
    numerics: str = "exact"
    # Where the server listens (multiaddrs without /p2p/): a client whose libp2p daemon still knows an old
    # address (the server restarted elsewhere with the same identity) dials these. Trustworthy because only
    # the server's own key can write its record.
    addresses: list[str] = field(default_factory=list)
    # The server also holds the final norm and the output head (``--head``, only with the last block) and
    # answers a client's head query with the sampler's predictions instead of hidden states.
    head: bool = False
    # The per-block adapter kinds (deep_prompt, bottleneck, lora) its blocks apply. A record without the field is from a
    # server that predates it: it may treat any per-block tensor as a deep prompt (a bottleneck's weights added to
    # the first rows: wrong numbers, no error), so clients send per-block adapters only to servers that list them.
    adapter_kinds: list[str] = field(default_factory=list)
    # Its passes are batch-invariant (``swarm.models.invariance.check_module`` held on its device): batching states
    # in one call, or other clients' rows with them, changes no token. A record without the field says no, so
    # clients at scale="auto" batch no states through it.
    batch_invariant: bool = False

    @property
    def approximate(self) -> bool:
        return self.numerics != "exact"

    def to_value(self) -> dict[str, Any]:
        value = dataclasses.asdict(self)
        value.pop("peer_id")
        value["state"] = int(self.state)
        value["record_version"] = RECORD_VERSION
        return value

    @classmethod
    def from_value(cls, peer_id: str, value: Any) -> Optional["ServerRecord"]:
        """Parse a stored value, every field bounded; None (and a debug line) for anything else, never an
        exception."""
        try:
            _check_version(value)
            record = cls(
                peer_id=peer_id, state=ServerState(fields.integer(value["state"], 0, 2)),
                start=fields.integer(value["start"], 0, MAX_BLOCKS), end=fields.integer(value["end"], 1, MAX_BLOCKS),
                throughput=_throughput(value["throughput"]),
                public_name=_optional_text(value.get("public_name")),
                version=fields.text(value.get("version", ""), MAX_VERSION_CHARS),
                cache_tokens_left=fields.integer(value.get("cache_tokens_left", 0)),
                experts=_texts(value.get("experts", [])), extra=fields.scalar_map(value.get("extra", {})),
                numerics=fields.text(value.get("numerics", "exact"), MAX_NUMERICS_CHARS),
                addresses=_addresses(value.get("addresses", [])), head=value.get("head", False) is True,
                adapter_kinds=fields.texts(value.get("adapter_kinds", []), MAX_ADAPTER_KINDS, MAX_NAME_CHARS),
                batch_invariant=value.get("batch_invariant", False) is True,
            )
            if not record.start < record.end:
                raise ValueError(f"bad span {record.start}:{record.end}")
            return record
        except Exception as error:  # remote input: whatever it is, it is not a record (never raise to a reader)
            logger.debug("ignoring malformed record from %s: %s", peer_id, _describe(error))
            return None


MAX_ADDRESSES, MAX_ADDRESS_CHARS = 8, 256
MAX_NAME_CHARS, MAX_EXPERTS = 120, 32  # a record's public name, and the expert names a server record lists
MAX_VERSION_CHARS, MAX_ADAPTER_KINDS = 64, 8
MAX_THROUGHPUT = 1e12


def _check_version(value: Any) -> None:
    if not isinstance(value, dict) or value.get("record_version") != RECORD_VERSION:
        raise ValueError("unknown record version")


def _describe(error: BaseException) -> str:
    """An exception as a short log text (str() of some exceptions is itself huge or raises)."""
    try:
        return f"{type(error).__name__}: {str(error)[:200]}"
    except Exception:  # noqa: BLE001 - describing must never fail
        return type(error).__name__


def _throughput(raw: Any) -> float:
    """An announced speed: a finite number >= 0 (a NaN would make every route through it cost NaN), or ValueError."""
    return fields.number(raw, 0.0, MAX_THROUGHPUT)


def _optional_text(raw: Any) -> Optional[str]:
    """An optional short text (a public name), or ValueError."""
    return fields.optional_text(raw, MAX_NAME_CHARS)


def _texts(raw: Any) -> list[str]:
    """A short list of short texts (expert names), or ValueError."""
    return fields.texts(raw, MAX_EXPERTS, MAX_NAME_CHARS)


def _addresses(raw: Any) -> list[str]:
    """A record's listening addresses: a short list of short strings, or a ValueError."""
    if not isinstance(raw, list) or len(raw) > MAX_ADDRESSES or \
            not all(isinstance(a, str) and 0 < len(a) <= MAX_ADDRESS_CHARS for a in raw):
        raise ValueError(f"addresses must be a list of at most {MAX_ADDRESSES} strings")
    return [fields.text(a, MAX_ADDRESS_CHARS) for a in raw]


@dataclass
class ExpertRecord:
    """A server's announcement of one hosted expert, in its entry of the expert index ``{prefix}.experts``."""

    peer_id: str
    domain: str
    state: ServerState
    tag: CompatibilityTag  # clients refuse experts whose tag differs from their backbone's
    throughput: float  # tokens per second through the whole expert model
    model: str = ""  # what the server loaded (embedded name or directory name)
    public_name: Optional[str] = None
    version: str = ""

    def to_value(self) -> dict[str, Any]:
        return {"record_version": RECORD_VERSION, "domain": self.domain, "state": int(self.state),
                "tag": self.tag.to_value(), "throughput": self.throughput, "model": self.model,
                "public_name": self.public_name, "version": self.version}

    @classmethod
    def from_value(cls, peer_id: str, value: Any) -> Optional["ExpertRecord"]:
        """Parse a stored value, every field bounded; None (and a debug line) for anything else, never an
        exception."""
        try:
            _check_version(value)
            domain = fields.text(value["domain"], MAX_DOMAIN_CHARS)
            if not domain:
                raise ValueError("empty domain")
            return cls(
                peer_id=peer_id, domain=domain, state=ServerState(fields.integer(value["state"], 0, 2)),
                tag=CompatibilityTag.from_value(value["tag"]), throughput=_throughput(value["throughput"]),
                model=fields.text(value.get("model", ""), MAX_NAME_CHARS),
                public_name=_optional_text(value.get("public_name")),
                version=fields.text(value.get("version", ""), MAX_VERSION_CHARS),
            )
        except Exception as error:  # remote input: never raise to a reader
            logger.debug("ignoring malformed expert record from %s: %s", peer_id, _describe(error))
            return None


MAX_DOMAIN_CHARS = 64
MAX_EXPERTS_PER_SERVER = 8  # expert records one server lists in its index entry
MAX_EXPERT_DOMAINS = 256  # distinct domains a reader keeps from the whole index (the rest are dropped, loudly)


def default_prefix(model_path: Path) -> str:
    """The DHT namespace of a model when none is given: its directory name (``default`` for the embedded one)."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", Path(model_path).name).strip("-")
    return (name or "model")[:128]  # what a key's prefix may be (swarm.dht.keys.PARTS)


def block_key(prefix: str, block: int) -> str:
    return BLOCK.key(prefix=prefix, block=block)


def expert_index_key(prefix: str) -> str:
    """Where each expert-hosting server lists its expert records (the DHT cannot list keys)."""
    return EXPERTS.key(prefix=prefix)


def governance_key(prefix: str) -> str:
    """Where the signed halt / resume decisions live (``swarm.governance.records``)."""
    return GOVERNANCE.key(prefix=prefix)


def adapter_index_key(prefix: str) -> str:
    """Where each adapter author lists the names it published (``swarm.adapters.sharing``)."""
    return ADAPTER_INDEX.key(prefix=prefix)


def adapter_versions_key(prefix: str, name: str) -> str:
    """Where each publisher of an adapter name lists that name's versions, in its signed slot
    (``swarm.adapters.versions``). ``adapter-versions`` and not ``adapters.versions``: names may hold dots."""
    return ADAPTER_VERSIONS.key(prefix=prefix, name=name)


def audit_key(prefix: str, auditor: str) -> str:
    """Where the auditor with this Ed25519 public key (base64) publishes its signed report (``swarm.reports.records``):
    one key per auditor, so a reader reads only the auditors it trusts and each is protected by their key."""
    return AUDIT.key(prefix=prefix, auditor=auditor)


# What the swarm's keys may hold is declared with each key in swarm.dht.keys; these names stay for readers.
MAX_OWNED_VALUE_BYTES = BLOCK.max_value_bytes
MAX_OWNED_SUBKEYS = BLOCK.max_subkeys  # servers per block key (and expert-hosting servers) one storing peer keeps
MAX_DECISION_VALUE_BYTES = GOVERNANCE.max_value_bytes
MAX_UNTRUSTED_SLOTS = GOVERNANCE.max_subkeys  # governance slots kept by a peer that trusts no key
MAX_ADAPTER_INDEX_BYTES, MAX_ADAPTER_AUTHORS = ADAPTER_INDEX.max_value_bytes, ADAPTER_INDEX.max_subkeys
MAX_AUDIT_VALUE_BYTES = AUDIT.max_value_bytes
# An adapter name's versions (adapter_versions_key): declared in swarm.dht.keys (ADAPTER_VERSIONS).
MAX_ADAPTER_VERSIONS_BYTES = ADAPTER_VERSIONS.max_value_bytes
MAX_ADAPTER_VERSION_PUBLISHERS = ADAPTER_VERSIONS.max_subkeys


def protected_keys(prefix: str, num_blocks: int = 0, governance_signers: Optional[Iterable[str]] = None,
                   auditors: Optional[Iterable[str]] = None, coordinators: Iterable[str] = ()) -> list[KeyPolicy]:
    """The keys of the model ``prefix`` a process can list, with what each may hold (``start_dht(protect=...)``):
    it refuses what does not fit them before any honest record arrives. Keys it cannot list (names, digests) are
    protected from the first value that names them (``swarm.dht.keys``).

    ``governance_signers``: the trusted governance public keys (base64); a process that trusts some keeps only
    their slots under the governance key, one that trusts none keeps any signed slot (bounded in count), and its
    storage makes room for their slots under names (:func:`swarm.dht.keys.trusted_keys`).
    ``auditors``: the auditors' public keys (base64) whose report keys it lists (default: the governance signers,
    the auditors a client trusts by default). ``coordinators``: the stream coordinators' keys whose stream records
    it reads.
    """
    signers = frozenset(governance_signers or ())
    audit_signers = sorted(set(signers) if auditors is None else set(auditors))
    keys = [*(block_key(prefix, block) for block in range(min(num_blocks, MAX_BLOCKS))), expert_index_key(prefix),
            governance_key(prefix), *(GOVERNANCE_OWN.key(prefix=prefix, signer=signer_id(s)) for s in sorted(signers)),
            adapter_index_key(prefix), *(audit_key(prefix, a) for a in audit_signers),
            *(STREAMS.key(prefix=prefix, coordinator=c) for c in sorted(set(coordinators)))]
    return [family_of(key).policy(key, signers) for key in keys]


async def _store(dht: DHT, node: DHTNode, keys: list[str], subkey: bytes, values: list, expiration: float) -> bool:
    values = [describe(key, value) for key, value in zip(keys, values)]  # storing peers see which key it is
    results = await node.store_many(keys, subkeys=[subkey] * len(keys), values=values,
                                    expiration_time=expiration, num_workers=min(32, len(keys)))
    return all(results.values())


def store_owned(dht: DHT, keys: list[str], subkey: bytes, values: list, expiration: float, wait: bool = True):
    """Store ``values[i]`` under ``keys[i]`` and this peer's owner ``subkey``: True when every store succeeded (a
    future of it when ``wait`` is false)."""
    return dht.run_coroutine(partial(_store, keys=keys, subkey=subkey, values=values, expiration=expiration),
                             return_future=not wait)


def declare_span(dht: DHT, prefix: str, record: ServerRecord, subkey: bytes, expiration: float, wait: bool = True):
    """Store ``record`` under every block key of its span (a future when ``wait`` is false)."""
    keys = [block_key(prefix, b) for b in range(record.start, record.end)]
    return store_owned(dht, keys, subkey, [record.to_value()] * len(keys), expiration, wait)


def declare_experts(dht: DHT, prefix: str, records: list[ExpertRecord], subkey: bytes, expiration: float,
                    wait: bool = True):
    """Store this server's expert records (at most :data:`MAX_EXPERTS_PER_SERVER`) as its entry of the index."""
    if len(records) > MAX_EXPERTS_PER_SERVER:
        logger.warning("a server announces at most %d experts: %s are not announced", MAX_EXPERTS_PER_SERVER,
                       ", ".join(r.domain for r in records[MAX_EXPERTS_PER_SERVER:]))
        records = records[:MAX_EXPERTS_PER_SERVER]
    value = {"record_version": RECORD_VERSION, "experts": [r.to_value() for r in records]}
    return store_owned(dht, [expert_index_key(prefix)], subkey, [value], expiration, wait)


async def _read(dht: DHT, node: DHTNode, keys: list[str]) -> dict[str, dict[Any, tuple[Any, float]]]:
    for storage in (node.protocol.storage, node.protocol.cache):
        if isinstance(storage, ProtectedStorage):  # a swarm peer: it knows these keys' policies from now on
            for key in keys:
                storage.learn(key)
    found = await node.get_many(keys, sufficient_expiration_time=float("inf"))  # the latest records
    # Unwrap hivemind's nested ValueWithExpiration into plain {key: {subkey: (value, expiration)}} for pickling
    # across processes.
    out = {}
    for key, entry in found.items():
        if entry is None or not isinstance(entry.value, dict):  # hivemind unpacks a key's dictionary into a dict
            continue
        out[key] = {subkey: (item.value, item.expiration_time) for subkey, item in entry.value.items()}
    return out


def read_entries(dht: DHT, keys: Iterable[str]) -> dict[str, dict[Any, tuple[Any, float]]]:
    """Every entry under ``keys`` as the swarm returns them, ``{key: {subkey: (value, expiration)}}``: the one read
    of the swarm's keys (every read and store of the code goes through this module's helpers; the keys are those of
    ``swarm.dht.keys``). This peer learns each key's policy first, so that neither its own storage nor another peer's
    reply can put a regular value in place of the key's records (``swarm.dht.node``)."""
    return dht.run_coroutine(partial(_read, keys=list(keys)))


def read_servers(dht: DHT, prefix: str, num_blocks: int) -> dict[str, ServerRecord]:
    """Every server announced for any block of the model, by peer id (its most complete record)."""
    servers: dict[str, ServerRecord] = {}
    for _, peer_id, value in read_owned(dht, [block_key(prefix, b) for b in range(num_blocks)]):
        record = ServerRecord.from_value(peer_id, value)
        if record is not None and record.end <= num_blocks:
            servers.setdefault(peer_id, record)
    return servers


def _records(found: dict) -> Iterator[tuple[str, str, Any]]:
    """(key, peer id, value) of every entry read by :func:`_get_many` whose owner key proves its peer id."""
    for key, subkeys in found.items():
        for subkey, value in subkeys.items():
            peer_id = owner_peer_id(subkey)
            if peer_id:
                yield key, peer_id, value
            else:
                logger.debug("ignoring an entry under %s whose subkey proves no peer id: %r", key, subkey)


def read_owned(dht: DHT, keys: Iterable[str]) -> Iterator[tuple[str, str, Any]]:
    """(key, peer id, value) of every entry under ``keys`` that its peer provably wrote."""
    return _records({key: {subkey: value for subkey, (value, _) in entries.items()}
                     for key, entries in read_entries(dht, keys).items()})


def parse_expert_entry(peer_id: str, value: Any) -> list[ExpertRecord]:
    """The expert records of one server's index entry (malformed ones dropped; never raises)."""
    if not isinstance(value, dict) or value.get("record_version") != RECORD_VERSION \
            or not isinstance(value.get("experts"), list):
        logger.debug("ignoring a malformed expert index entry from %s", peer_id)
        return []
    parsed = (ExpertRecord.from_value(peer_id, item) for item in value["experts"][:MAX_EXPERTS_PER_SERVER])
    return [record for record in parsed if record is not None]


def read_all_experts(dht: DHT, prefix: str) -> dict[str, dict[str, ExpertRecord]]:
    """Every announced expert, by domain then peer id: one read of the index key, at most
    :data:`MAX_EXPERT_DOMAINS` domains (the first in name order; a warning says when more were dropped)."""
    found: dict[str, dict[str, ExpertRecord]] = {}
    for _, peer_id, value in read_owned(dht, [expert_index_key(prefix)]):
        for record in parse_expert_entry(peer_id, value):
            found.setdefault(record.domain, {})[peer_id] = record
    if len(found) > MAX_EXPERT_DOMAINS:
        logger.warning("the expert index of %s lists %d domains; keeping the first %d", prefix, len(found),
                       MAX_EXPERT_DOMAINS)
        found = {domain: found[domain] for domain in sorted(found)[:MAX_EXPERT_DOMAINS]}
    return found


def read_expert_records(dht: DHT, prefix: str, domain: str) -> dict[str, ExpertRecord]:
    """Every server announcing the expert ``domain``, by peer id."""
    return read_all_experts(dht, prefix).get(domain, {})


def read_expert_domains(dht: DHT, prefix: str) -> set[str]:
    """Expert domains listed under the index key by any server."""
    return set(read_all_experts(dht, prefix))


async def _forget(dht: DHT, node: DHTNode, keys: list[str]) -> None:
    for key_id in map(DHTID.generate, keys):
        for storage in (node.protocol.storage, node.protocol.cache):
            if storage.get(key_id) is not None:
                del storage[key_id]


def forget_local_copies(dht: DHT, keys: Iterable[str]) -> None:
    """Drop this peer's own copies of ``keys`` (stored or cached), so that the next read of them is what other
    peers answer: a writer checking that readers get its record back must not read its own copy."""
    dht.run_coroutine(partial(_forget, keys=list(keys)))


def now() -> float:
    return get_dht_time()
