"""Sharing adapters: a name published by its author's key, files served by any server, fetched by hash.

Three kinds of DHT entries, all small (adapter bytes never go into the DHT):

* ``{prefix}.adapters.{name}@{author}``: the published record (:class:`PublishedAdapter`: base model, training
  metadata, size, sha256 content hash, evaluation score, hosts seen at publication), in the signed slot of its
  author's Ed25519 key (``swarm.dht.validation``; ``author``: the key's id, 16 hex digits of its sha256): only that
  key can write there, at any storing peer, so no flood of other keys keeps it out (issue 55). The same record goes to
  the shared ``{prefix}.adapters.{name}``, one slot per author, which lists who uses a name (and is what readers
  before issue 55 read). Several authors may use one name; a client then refuses to guess and asks for
  ``name@AUTHOR``.
* ``{prefix}.adapter-index.{author}``: each author's list of names, in the same own slot, and beside it the shared
  ``{prefix}.adapters``, one slot per author (the DHT cannot list keys: the health map reads names from here).
  Readers read the authors they trust first, then a fair sample of the others' names (``swarm.dht.sample``).
* ``{prefix}.adapter-hosts.{sha256}``: servers started with ``--serve-adapter DIR`` announce the content they
  serve under their owner subkey (the same rule as block records), so any server can host any adapter.

A client resolves a name to a record, checks the base model and the size before fetching, fetches the files
from a host (``rpc_adapter_files``), checks the size and the content hash, and keeps them in a cache directory.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht import DHT
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.adapters.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MAX_CONFIG_BYTES,
    MAX_WEIGHTS_BYTES,
    AdapterConfig,
    AdapterError,
    PromptAdapter,
)
from swarm.adapters.block import is_sha256_hex
from swarm.adapters.limits import PUBLISH_LIFETIME
from swarm.dht.config import MAX_PEER_ID_CHARS
from swarm.dht.keys import ADAPTER_HOSTS, ADAPTER_INDEX_OWN, ADAPTER_NAME, ADAPTER_NAME_OWN, policy_for
from swarm.dht.sample import fair_sample
from swarm.dht.schema import (
    MAX_ADDRESS_CHARS,
    MAX_ADDRESSES,
    adapter_index_key,
    forget_local_copies,
    read_entries,
    read_owned,
    store_owned,
)
from swarm.dht.stamp import STAMP_FIELD, make_stamp
from swarm.dht.validation import (
    dht_key_id,
    ed25519_text,
    sign_slot,
    signer_id,
    slot_signer,
    slot_subkey,
    verify_slot,
)
from swarm.utils import fields

logger = logging.getLogger(__name__)

FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)  # the order files are hashed and sent in
MAX_ADAPTER_BYTES = MAX_CONFIG_BYTES + MAX_WEIGHTS_BYTES
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
AUTHOR_PATTERN = re.compile(r"[0-9a-f]{16}")
RECORD_VERSION = 1
MAX_NAMES_PER_AUTHOR = 64
MAX_HOSTS_LISTED = 16
MAX_HOSTS_READ = 64  # peers a client considers for one adapter's files
MAX_CATALOG_NAMES = 64  # names the catalog (the health map) reads records and hosts for
MAX_AUTHORS_READ = 64  # authors whose names a reader lists (as many as a peer that knows the model keeps)
MAX_SCORE = 1e12
ENV_CACHE = "SWARM_ADAPTER_CACHE"


# ----- names, keys and hashes -------------------------------------------------------------------------
def check_name(name: Any) -> str:
    """A publishable name: 1-64 letters, digits, ``_.-``, starting with a letter or digit."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise AdapterError(f"adapter name {name!r} must be 1-64 letters, digits, '_', '.' or '-', starting with a "
                           f"letter or digit")
    return name


def split_reference(reference: str) -> tuple[str, Optional[str]]:
    """``name`` or ``name@AUTHOR`` -> (name, author id or None)."""
    name, _, author = reference.partition("@")
    if author and not AUTHOR_PATTERN.fullmatch(author):
        raise AdapterError(f"author id {author!r} must be 16 lowercase hex digits (as python -m swarm.health lists)")
    return check_name(name), author or None


def author_id(public_key_text: str) -> str:
    """16 hex digits naming an author's key: short enough to type after ``name@`` (part of the author's own keys)."""
    return signer_id(public_key_text)


def name_key(prefix: str, name: str) -> str:
    return ADAPTER_NAME.key(prefix=prefix, name=name)


def own_name_key(prefix: str, name: str, author: str) -> str:
    """Where only the key with id ``author`` (16 hex digits) writes its record for ``name``."""
    return ADAPTER_NAME_OWN.key(prefix=prefix, name=name, signer=author)


def own_index_key(prefix: str, author: str) -> str:
    """Where only the key with id ``author`` lists the names it published."""
    return ADAPTER_INDEX_OWN.key(prefix=prefix, signer=author)


def index_key(prefix: str) -> str:
    """Each author's list of names (a key every peer that knows the model protects: signed slots only)."""
    return adapter_index_key(prefix)


def hosts_key(prefix: str, sha256: str) -> str:
    return ADAPTER_HOSTS.key(prefix=prefix, sha256=sha256)


def content_hash(files: dict[str, bytes]) -> str:
    """sha256 over each file's name, length and bytes, in :data:`FILES` order: names the exact content."""
    digest = hashlib.sha256()
    for name in FILES:
        data = files[name]
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def read_adapter_files(directory: str | Path, base: Optional[dict[str, Any]] = None) -> dict[str, bytes]:
    """The files of a valid adapter directory (checked by :meth:`PromptAdapter.load`, sizes capped)."""
    PromptAdapter.load(directory, base)
    return {name: (Path(directory) / name).read_bytes() for name in FILES}


def adapter_config(files: dict[str, bytes]) -> AdapterConfig:
    try:
        return AdapterConfig.from_dict(json.loads(files[ADAPTER_CONFIG]))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterError(f"{ADAPTER_CONFIG} is not valid JSON: {error}") from None


# ----- the published record --------------------------------------------------------------------------
@dataclass(frozen=True)
class PublishedAdapter:
    """What an author publishes under a name: enough to check an adapter before fetching it."""

    name: str
    sha256: str
    size: int
    base: dict[str, Any]
    training: dict[str, Any] = field(default_factory=dict)
    score: Optional[float] = None  # an evaluation score the author reports (e.g. exact match on held-out data)
    served_by: tuple[str, ...] = ()  # peers announcing the content when it was published
    published: float = 0.0  # the author's clock, seconds since the epoch
    author: str = ""  # the signing key (base64), filled in from the slot when read

    @property
    def author_id(self) -> str:
        return author_id(self.author)

    def payload(self) -> bytes:
        return MSGPackSerializer.dumps({
            "record_version": RECORD_VERSION, "name": self.name, "sha256": self.sha256, "size": self.size,
            "base": self.base, "training": self.training, "score": self.score, "served_by": list(self.served_by),
            "published": self.published})

    @classmethod
    def from_payload(cls, payload: bytes, author: str) -> "PublishedAdapter":
        """Parse a verified payload, every field bounded; ValueError for anything malformed (its author may still be
        careless or hostile: base and training are flat maps of scalars, numbers finite, lists capped)."""
        try:
            value = MSGPackSerializer.loads(payload)
        except Exception as error:  # msgpack raises many types on junk
            raise ValueError(f"not msgpack: {type(error).__name__}") from None
        if not isinstance(value, dict) or value.get("record_version") != RECORD_VERSION:
            raise ValueError("unknown adapter record version")
        sha, score = value.get("sha256"), value.get("score")
        if not is_sha256_hex(sha):
            raise ValueError("sha256 must be 64 hex digits")
        served = value.get("served_by", [])
        if not isinstance(served, list):
            raise ValueError("served_by must be a list of peer ids")
        # size: any positive integer here; check_before_fetch refuses one over MAX_ADAPTER_BYTES, saying so
        return cls(check_name(value.get("name")), sha, fields.integer(value.get("size"), 1),
                   fields.scalar_map(value.get("base")),
                   fields.scalar_map(value.get("training", {}), max_items=32, list_depth=2),
                   None if score is None else fields.number(score, -MAX_SCORE, MAX_SCORE),
                   tuple(fields.texts(served[:MAX_HOSTS_LISTED], MAX_HOSTS_LISTED, MAX_PEER_ID_CHARS)),
                   fields.number(value.get("published", 0.0), 0.0, 1e11), author)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "author": self.author_id, "sha256": self.sha256, "size": self.size,
                "score": self.score, "base": self.base, "training": self.training, "served_by": list(self.served_by),
                "published": self.published}


def signed_entries(dht: DHT, key: Optional[str], own: Optional[Mapping[str, str]] = None) -> list[tuple[str, bytes]]:
    """(signer, payload) of every entry under the shared ``key`` (None: none) whose Ed25519 signature holds, and of the
    entry under each key of ``own`` ({key: the signer id whose own key it is}) whose signer is that id; one read. The
    own keys' entries come first (a reader keeping one entry per signer keeps those on a tie). Anything else is ignored
    (a peer that stores without validating may hand back a stranger's slot signed over another's own key)."""
    signers = dict(own or {})
    by_key = verified_entries(read_entries(dht, [key, *signers] if key is not None else list(signers)), signers)
    own_entries = [entry for read, entries in by_key.items() if read in signers for entry in entries]
    return own_entries + (by_key.get(key, []) if key is not None else [])


def verified_entries(found: Mapping[str, Mapping], signers: Mapping[str, str]) -> dict[str, list[tuple[str, bytes]]]:
    """{key: (signer, payload) of each entry whose Ed25519 signature holds} of a read of several keys (under a key of
    ``signers``, only the entry of the signer whose own key it is): so that one read can serve several checks."""
    entries: dict[str, list[tuple[str, bytes]]] = {}
    for read, subkeys in found.items():
        for subkey, (value, expiration) in subkeys.items():
            try:
                payload = verify_slot(dht_key_id(read), subkey, value, expiration)
                if read in signers and signer_id(slot_signer(subkey)) != signers[read]:
                    raise ValueError(f"a slot of another key than {signers[read]}")
                entries.setdefault(read, []).append((slot_signer(subkey), payload))
            except ValueError as error:
                logger.debug("ignoring an entry under %s: %s", read, error)
    return entries


def read_published(dht: DHT, prefix: str, name: str, authors: Iterable[str] = ()) -> list[PublishedAdapter]:
    """Every validly signed record for ``name``, one per author (its newest): those of ``authors`` (ids) under their
    own keys, which nobody else can fill, and those the shared name key lists. One read."""
    own = {own_name_key(prefix, name, author): author for author in authors}
    return newest_records(name, signed_entries(dht, name_key(prefix, name), own))


def newest_records(name: str, entries: Iterable[tuple[str, bytes]]) -> list[PublishedAdapter]:
    """The records for ``name`` among signed entries, one per signer (its newest); malformed ones skipped."""
    records: dict[str, PublishedAdapter] = {}
    for signer, payload in entries:
        try:
            record = PublishedAdapter.from_payload(payload, signer)
        except Exception as error:  # remote input: whatever went wrong, it is not a record
            logger.debug("ignoring a malformed adapter record under %r: %s", name, str(error)[:200])
            continue
        held = records.get(signer)  # a record signed for another name cannot be moved here (the key is signed too)
        if record.name == name and (held is None or record.published > held.published):
            records[signer] = record
    return list(records.values())


def read_names(dht: DHT, prefix: str, authors: Iterable[str] = ()) -> dict[str, list[str]]:
    """Names each author lists, by the author's key: ``authors`` (ids) from their own index keys, the others from the
    shared index (at most :data:`MAX_AUTHORS_READ` authors). One read."""
    names: dict[str, list[str]] = {}
    own = {own_index_key(prefix, author): author for author in authors}
    for signer, payload in signed_entries(dht, index_key(prefix), own):
        if signer in names or len(names) < MAX_AUTHORS_READ + len(own):
            names[signer] = sorted(set(names.get(signer, [])) | set(_names(payload)))[:MAX_NAMES_PER_AUTHOR]
    return names


def _names(payload: bytes) -> list[str]:
    """The valid names an index entry lists (none for anything malformed)."""
    try:
        listed = MSGPackSerializer.loads(payload)
    except Exception:  # msgpack raises many types on junk
        return []
    return [n for n in listed[:MAX_NAMES_PER_AUTHOR] if isinstance(n, str) and NAME_PATTERN.fullmatch(n)] \
        if isinstance(listed, list) else []


def catalog_names(dht: DHT, prefix: str, limit: int, trusted: Iterable[str] = ()) -> list[tuple[str, str]]:
    """(author key, name) of at most ``limit`` names the index lists: those of the ``trusted`` authors (ids) first,
    then a fair sample of the others' (``swarm.dht.sample``: no author chooses what readers see)."""
    trusted = sorted(set(trusted))
    listed = read_names(dht, prefix, trusted)
    total = sum(map(len, listed.values()))
    if total > limit:
        logger.info("the adapter index of %s lists %d names; reading %d (trusted authors first, then a fair sample)",
                    prefix, total, limit)
    return fair_sample(listed, limit, [author for author in listed if author_id(author) in trusted])


def read_catalog(dht: DHT, prefix: str, trusted: Iterable[str] = ()) -> list[tuple[PublishedAdapter, list[str]]]:
    """The published adapters the index lists (:data:`MAX_CATALOG_NAMES` names at most, chosen by
    :func:`catalog_names`: each costs reads), with the peers serving each content now."""
    catalog = []
    for name, authors in names_with_authors(catalog_names(dht, prefix, MAX_CATALOG_NAMES, trusted)).items():
        for record in read_published(dht, prefix, name, authors):
            catalog.append((record, sorted(read_hosts(dht, prefix, record.sha256))))
    return catalog


def names_with_authors(chosen: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """{name: ids of the authors listing it} of (author key, name) pairs: whose own keys a reader of the name reads."""
    grouped: dict[str, list[str]] = {}
    for author, name in chosen:
        grouped.setdefault(name, []).append(author_id(author))
    return grouped


def signed_value(key: Ed25519PrivateKey, dht_key: str, payload: bytes, expiration: float) -> dict:
    """``payload`` signed for ``key``'s slot under ``dht_key``, with a work stamp where the key is a shared list
    (``swarm.dht.stamp``: made once per list and key)."""
    value = sign_slot(key, dht_key, payload, expiration)
    policy = policy_for(dht_key)
    if policy is not None and policy.stamp_bits > 0:
        value[STAMP_FIELD] = make_stamp(dht_key_id(dht_key), ed25519_text(key), policy.stamp_bits)
    return value


def store_slot(dht: DHT, key: Ed25519PrivateKey, dht_key: str, payload: bytes, expiration: float) -> bool:
    """Store :func:`signed_value` in ``key``'s slot under ``dht_key``: whether a storing peer took it."""
    value = signed_value(key, dht_key, payload, expiration)
    return bool(dht.store(dht_key, value, expiration_time=expiration, subkey=slot_subkey(key)))


def publish(dht: DHT, key: Ed25519PrivateKey, prefix: str, record: PublishedAdapter,
            lifetime: float = PUBLISH_LIFETIME) -> PublishedAdapter:
    """Sign and store ``record`` under the author's own name key and add the name to its own index entry (and to the
    shared name key and index, which list authors for readers who trust nobody); the stored record, read back from
    other peers, or :class:`AdapterError` when the own record or index entry is not read back. Shared keys that did not
    keep them (full of other keys' slots) are said in a warning. Publishing again replaces the author's record."""
    own = ed25519_text(key)
    author, expiration = author_id(own), get_dht_time() + lifetime
    listed = read_names(dht, prefix, [author]).get(own, [])
    names = sorted(set(listed) | {record.name})
    if len(names) > MAX_NAMES_PER_AUTHOR:
        raise AdapterError(f"an author may list at most {MAX_NAMES_PER_AUTHOR} names")
    own_name = own_name_key(prefix, record.name, author)
    shared_name = name_key(prefix, record.name)
    own_index = own_index_key(prefix, author)
    keys = [own_name, shared_name, own_index, index_key(prefix)]
    payloads = [record.payload()] * 2 + [MSGPackSerializer.dumps(names)] * 2
    stored = [store_slot(dht, key, keys[i], payloads[i], expiration) for i in range(len(keys))]
    forget_local_copies(dht, keys)  # what readers get, not this peer's own copy
    # One read of the three keys the checks below need (three reads of them were two DHT searches more a publish).
    back = verified_entries(read_entries(dht, [own_name, shared_name, own_index]),
                            {own_name: author, own_index: author})
    found = [r for r in newest_records(record.name, back.get(own_name, []) + back.get(shared_name, []))
             if r.author == own and r.sha256 == record.sha256]
    indexed = any(record.name in _names(payload) for _, payload in back.get(own_index, []))
    if not found or not indexed:
        raise AdapterError(f"the swarm did not keep the {'record' if not found else 'index entry'} for "
                           f"{record.name!r} (stores accepted: {sum(stored)} of {len(stored)})")
    if not any(r.author == own for r in newest_records(record.name, back.get(shared_name, []))):
        logger.warning("published %s under your own keys; the shared list of its authors is full, so readers who "
                       "neither trust you nor name %s@%s do not see it", record.name, record.name, author)
    return found[0]


def make_record(directory: str | Path, name: str, score: Optional[float], served_by: list[str]) -> PublishedAdapter:
    """The record of the adapter in ``directory`` (files checked) under ``name``."""
    files = read_adapter_files(directory)
    config = adapter_config(files)
    return PublishedAdapter(check_name(name), content_hash(files), sum(map(len, files.values())), config.base,
                            config.training, score, tuple(served_by[:MAX_HOSTS_LISTED]), time.time())


# ----- hosts -------------------------------------------------------------------------------------------
def declare_hosted(dht: DHT, prefix: str, hosted: dict[str, int], subkey: bytes, expiration: float,
                   addresses: list[str], wait: bool = True):
    """Announce the content hashes a server serves (``{sha256: size}``) and where it listens, under its owner
    subkey."""
    keys = [hosts_key(prefix, sha) for sha in hosted]
    values = [{"record_version": RECORD_VERSION, "size": size, "addresses": addresses[:MAX_ADDRESSES]}
              for size in hosted.values()]
    return store_owned(dht, keys, subkey, values, expiration, wait)


def read_hosts(dht: DHT, prefix: str, sha256: str) -> dict[str, list[str]]:
    """Peers that provably announced serving ``sha256``, with the addresses they announce."""
    hosts = {}
    for _, peer_id, value in read_owned(dht, [hosts_key(prefix, sha256)]):
        if isinstance(value, dict) and value.get("record_version") == RECORD_VERSION:
            addresses = value.get("addresses", [])
            hosts[peer_id] = [fields.text(a, MAX_ADDRESS_CHARS) for a in addresses[:MAX_ADDRESSES]
                              if isinstance(a, str)] if isinstance(addresses, list) else []
        if len(hosts) >= MAX_HOSTS_READ:
            break
    return hosts


class AdapterLibrary:
    """The adapters a server serves, in memory (each at most :data:`MAX_ADAPTER_BYTES`), by content hash."""

    def __init__(self, directories: tuple[str, ...] | list[str] = ()):
        self.files: dict[str, dict[str, bytes]] = {}
        for directory in directories:
            files = read_adapter_files(directory)
            self.files[content_hash(files)] = files
            logger.info("serving adapter %s as %s", directory, content_hash(files))

    @property
    def sizes(self) -> dict[str, int]:
        return {sha: sum(map(len, files.values())) for sha, files in self.files.items()}

    def get(self, sha256: str) -> Optional[dict[str, bytes]]:
        return self.files.get(sha256)


# ----- fetching and caching ---------------------------------------------------------------------------
def default_cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "swarm" / "adapters")


def choose_record(records: list[PublishedAdapter], reference: str, author: Optional[str]) -> PublishedAdapter:
    """The one record a reference names; a clear error for none, or for several authors without ``@AUTHOR``."""
    if author is not None:
        records = [r for r in records if r.author_id == author]
    if not records:
        raise AdapterError(f"no adapter is published under {reference!r} (not a directory either); "
                           f"python -m swarm.health lists published adapters")
    if len({r.author for r in records}) > 1:
        authors = ", ".join(sorted(f"{r.name}@{r.author_id}" for r in records))
        raise AdapterError(f"several authors published {reference!r}: choose one of {authors}")
    return records[0]


def check_before_fetch(record: PublishedAdapter, base: dict[str, Any]) -> None:
    """Refuse what can be refused from the record alone: an oversized adapter or another base model."""
    if record.size > MAX_ADAPTER_BYTES:
        raise AdapterError(f"adapter {record.name!r} declares {record.size} bytes, over the limit of "
                           f"{MAX_ADAPTER_BYTES}")
    AdapterConfig(1, 1, record.base).require_base(base, repr(record.name))


def check_fetched(record: PublishedAdapter, files: dict[str, bytes], peer_id: str) -> None:
    """The files a host sent must be exactly the published content."""
    size = sum(map(len, files.values()))
    if size != record.size:
        raise AdapterError(f"peer {peer_id} sent {size} bytes for adapter {record.name!r}, the record says "
                           f"{record.size}")
    if content_hash(files) != record.sha256:
        raise AdapterError(f"peer {peer_id} sent files for adapter {record.name!r} whose sha256 differs from the "
                           f"published one")


def cached(cache_dir: Path, record: PublishedAdapter) -> Optional[Path]:
    """The cached copy of ``record``'s content if present and intact (its hash is checked again)."""
    directory = cache_dir / record.sha256
    try:
        files = {name: (directory / name).read_bytes() for name in FILES}
    except OSError:
        return None
    return directory if content_hash(files) == record.sha256 else None


def store_in_cache(cache_dir: Path, record: PublishedAdapter, files: dict[str, bytes]) -> Path:
    """Write checked files to ``cache_dir/SHA256`` (whole or not at all)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / record.sha256
    staging = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".partial-"))
    try:
        for name in FILES:
            (staging / name).write_bytes(files[name])
        if target.exists():
            shutil.rmtree(target)
        staging.replace(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# (peer, addresses, sha256, max bytes) -> files; a peer that fails or refuses raises AdapterError (the client's
# fetcher turns its RemoteError into one), and the next host is tried.
Fetch = Callable[[str, list[str], str, int], dict[str, bytes]]


def fetch_published(dht: DHT, prefix: str, reference: str, base: dict[str, Any], cache_dir: Path,
                    fetch: Fetch) -> Path:
    """The directory of the published adapter ``reference`` (``name`` or ``name@AUTHOR``): from the cache, or
    fetched from a peer that serves it and checked (size, content hash) first. :class:`AdapterError` otherwise."""
    name, author = split_reference(reference)
    record = choose_record(read_published(dht, prefix, name), reference, author)
    return fetch_record(dht, prefix, record, reference, base, cache_dir, fetch)


def fetch_record(dht: DHT, prefix: str, record: PublishedAdapter, reference: str, base: dict[str, Any],
                 cache_dir: Path, fetch: Fetch) -> Path:
    """The directory of ``record``'s content (``reference`` names it in messages): from the cache, or fetched from a
    peer that serves it and checked (size, content hash) first. :class:`AdapterError` otherwise."""
    check_before_fetch(record, base)
    directory = cached(cache_dir, record)
    if directory is not None:
        return directory
    hosts = {peer_id: [] for peer_id in record.served_by} | read_hosts(dht, prefix, record.sha256)
    if not hosts:
        raise AdapterError(f"adapter {reference!r} is published but no peer serves its files now (start a server "
                           f"with --serve-adapter DIR)")
    failures = []
    for peer_id, addresses in hosts.items():
        try:
            files = fetch(peer_id, addresses, record.sha256, record.size)
            check_fetched(record, files, peer_id)
        except AdapterError as error:
            logger.warning("adapter %r from %s refused: %s", reference, peer_id, error)
            failures.append(str(error))
            continue
        logger.info("fetched adapter %r (%d bytes, sha256 %s) from %s", reference, record.size, record.sha256, peer_id)
        return store_in_cache(cache_dir, record, files)
    raise AdapterError(f"no peer served adapter {reference!r} as published: {'; '.join(failures)}")
