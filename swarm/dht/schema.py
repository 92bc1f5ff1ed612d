"""DHT keys and records: what a server announces and how clients read it.

One key per block, ``{prefix}.{block}``; the subkey is the server's peer id followed by its RSA owner tag
(``[owner:ssh-rsa …]``), whose key is the server's libp2p identity. hivemind's ``RSASignatureValidator`` only
accepts writes signed by that key, and ``swarm.dht.validation`` only those whose key derives the peer id in
front of it; readers here apply the same rule (:func:`swarm.dht.validation.owner_peer_id`) and ignore every other entry.
Experts announce under ``{prefix}.experts.{domain}`` the same way (an :class:`ExpertRecord` with the
compatibility tag), and list their domains under ``{prefix}.experts`` so that readers who cannot list keys
(the health map) find them.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import math
import re
from dataclasses import dataclass, field
from functools import partial  # picklable: run_coroutine ships it to the DHT process
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from hivemind.dht import DHT, DHTNode
from hivemind.utils import get_dht_time

from swarm.dht.compatibility import CompatibilityTag
from swarm.dht.validation import owner_peer_id

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
        """Parse a stored value; None (and a log line) for anything malformed, never an exception."""
        try:
            if not isinstance(value, dict) or value.get("record_version") != RECORD_VERSION:
                raise ValueError("unknown record version")
            record = cls(
                peer_id=peer_id, state=ServerState(int(value["state"])), start=int(value["start"]),
                end=int(value["end"]), throughput=_throughput(value["throughput"]),
                public_name=_optional_text(value.get("public_name")),
                version=str(value.get("version", "")), cache_tokens_left=int(value.get("cache_tokens_left", 0)),
                experts=_texts(value.get("experts", [])), extra=dict(value.get("extra", {})),
                numerics=str(value.get("numerics", "exact"))[:MAX_NUMERICS_CHARS],
                addresses=_addresses(value.get("addresses", [])), head=value.get("head", False) is True,
                adapter_kinds=_texts(value.get("adapter_kinds", [])),
            )
            if not 0 <= record.start < record.end:
                raise ValueError(f"bad span {record.start}:{record.end}")
            return record
        except (KeyError, TypeError, ValueError) as error:
            logger.debug("ignoring malformed record from %s: %s", peer_id, error)
            return None


MAX_ADDRESSES, MAX_ADDRESS_CHARS = 8, 256
MAX_NAME_CHARS, MAX_EXPERTS = 120, 32  # a record's public name, and the expert names a server record lists


def _throughput(raw: Any) -> float:
    """An announced speed: a finite number >= 0 (a NaN would make every route through it cost NaN), or ValueError."""
    value = float(raw)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"bad throughput {raw!r}")
    return value


def _optional_text(raw: Any) -> Optional[str]:
    """An optional short text (a public name), or ValueError."""
    if raw is not None and not isinstance(raw, str):
        raise ValueError(f"a text field holds {type(raw).__name__}")
    return None if raw is None else raw[:MAX_NAME_CHARS]


def _texts(raw: Any) -> list[str]:
    """A short list of short texts (expert names), or ValueError."""
    if not isinstance(raw, list) or len(raw) > MAX_EXPERTS or not all(isinstance(item, str) for item in raw):
        raise ValueError("expert names must be a short list of texts")
    return [item[:MAX_NAME_CHARS] for item in raw]


def _addresses(raw: Any) -> list[str]:
    """A record's listening addresses: a short list of short strings, or a ValueError."""
    if not isinstance(raw, list) or len(raw) > MAX_ADDRESSES or \
            not all(isinstance(a, str) and 0 < len(a) <= MAX_ADDRESS_CHARS for a in raw):
        raise ValueError(f"addresses must be a list of at most {MAX_ADDRESSES} strings")
    return list(raw)


@dataclass
class ExpertRecord:
    """A server's announcement of one hosted expert, under ``{prefix}.experts.{domain}``."""

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
        """Parse a stored value; None (and a log line) for anything malformed, never an exception."""
        try:
            if not isinstance(value, dict) or value.get("record_version") != RECORD_VERSION:
                raise ValueError("unknown record version")
            record = cls(
                peer_id=peer_id, domain=str(value["domain"]), state=ServerState(int(value["state"])),
                tag=CompatibilityTag.from_value(value["tag"]), throughput=_throughput(value["throughput"]),
                model=str(value.get("model", "")), public_name=_optional_text(value.get("public_name")),
                version=str(value.get("version", "")),
            )
            return record
        except (KeyError, TypeError, ValueError) as error:
            logger.debug("ignoring malformed expert record from %s: %s", peer_id, error)
            return None


def default_prefix(model_path: Path) -> str:
    """The DHT namespace of a model when none is given: its directory name (``default`` for the embedded one)."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", Path(model_path).name).strip("-")
    return name or "model"


def block_key(prefix: str, block: int) -> str:
    return f"{prefix}.{block}"


def expert_key(prefix: str, domain: str) -> str:
    """Where servers hosting the expert ``domain`` announce it."""
    return f"{prefix}.experts.{domain}"


def expert_index_key(prefix: str) -> str:
    """Where each expert-hosting server lists its domains (the DHT cannot list keys)."""
    return f"{prefix}.experts"


async def _store(dht: DHT, node: DHTNode, keys: list[str], subkey: bytes, values: list, expiration: float) -> bool:
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
    """Store each record under its domain's key and the list of domains under the index key."""
    keys = [expert_key(prefix, r.domain) for r in records] + [expert_index_key(prefix)]
    values = [r.to_value() for r in records] + [sorted(r.domain for r in records)]
    return store_owned(dht, keys, subkey, values, expiration, wait)


async def _get_many(dht: DHT, node: DHTNode, keys: list[str]) -> dict:
    found = await node.get_many(keys, sufficient_expiration_time=float("inf"))  # the latest records
    # Unwrap hivemind's nested ValueWithExpiration into plain {key: {subkey: value}} for pickling across processes.
    out = {}
    for key, entry in found.items():
        if entry is None or not isinstance(entry.value, dict):
            continue
        out[key] = {subkey: item.value for subkey, item in entry.value.items()}
    return out


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
    return _records(dht.run_coroutine(partial(_get_many, keys=list(keys))))


def read_expert_records(dht: DHT, prefix: str, domain: str) -> dict[str, ExpertRecord]:
    """Every server announcing the expert ``domain``, by peer id (records for another domain are ignored)."""
    records = {}
    for _, peer_id, value in read_owned(dht, [expert_key(prefix, domain)]):
        record = ExpertRecord.from_value(peer_id, value)
        if record is not None and record.domain == domain:
            records[peer_id] = record
    return records


def read_expert_domains(dht: DHT, prefix: str) -> set[str]:
    """Expert domains listed under the index key by any server."""
    domains = set()
    for _, _, value in read_owned(dht, [expert_index_key(prefix)]):
        if isinstance(value, (list, tuple)):
            domains.update(d for d in value if isinstance(d, str) and d)
    return domains


def now() -> float:
    return get_dht_time()
