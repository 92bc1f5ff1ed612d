"""Versions of a published adapter name: ordered, content-addressed, signed by their publisher, withdrawable.

A publisher's name record (``swarm.adapters.sharing``) says what ``NAME`` holds now; its versions live beside it under
``{prefix}.adapter-versions.{name}@{author}``, in the publisher's signed slot under its own key (the same Ed25519 slot
signing as the name records: only that key can write there, so nobody can publish a version under another's name, and
no flood of other keys can keep the list out). The shared ``{prefix}.adapter-versions.{name}`` of readers before issue
55 is written too and still read. The slot holds one
:class:`VersionList`: at most :data:`MAX_VERSIONS` versions in increasing order, each naming

* its number (1, 2, ...: the order), its files' content hash (its identity: a host's files are checked against it
  before use) and size;
* its parent (the content hash it was trained from; None for a first version);
* a digest of the data it saw (sha256 of the training examples, so two versions trained on the same data say so);
* the publisher's own held-out figure, and whether the publisher withdrew it.

**A withdrawal follows the content** (issue 55): a content hash that a publisher withdrew is withdrawn under every name
and publisher carrying it that a reader reads (the catalog, the auditor's scoring, ``best:TASK``, a resolved name), so a
stranger who republishes withdrawn content cannot bring it back. Whose withdrawals count: a reader that trusts
publishers counts theirs and the carrying record's own publisher's; a reader that trusts none counts everybody's (it
cannot tell a withdrawal that protects it from one that only hides content, and refusing is the safe side).

A client asks for ``NAME`` (the name record, unless its content is a withdrawn version), ``NAME@VERSION`` (that
version of the one publisher of the name) or ``NAME@AUTHOR@VERSION``, or ``best:TASK`` (``swarm.reports.adoption``).
Bounds: a list over :data:`MAX_VERSIONS` entries or :data:`~swarm.dht.schema.MAX_ADAPTER_VERSIONS_BYTES` bytes is
refused by readers and never written (publishing drops the oldest instead), and readers read at most
:data:`~swarm.dht.schema.MAX_ADAPTER_VERSION_PUBLISHERS` publishers per name.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht import DHT
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.adapters.adapter import AdapterError
from swarm.adapters.block import is_sha256_hex
from swarm.adapters.limits import PUBLISH_LIFETIME
from swarm.adapters.sharing import (
    AUTHOR_PATTERN,
    MAX_SCORE,
    Fetch,
    PublishedAdapter,
    author_id,
    catalog_names,
    check_name,
    fetch_record,
    make_record,
    names_with_authors,
    publish,
    read_published,
    signed_entries,
    store_slot,
)
from swarm.dht.keys import ADAPTER_VERSIONS_OWN
from swarm.dht.schema import (
    MAX_ADAPTER_VERSION_PUBLISHERS,
    MAX_ADAPTER_VERSIONS_BYTES,
    adapter_versions_key,
    forget_local_copies,
)
from swarm.dht.validation import ed25519_text
from swarm.utils import fields

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
MAX_VERSIONS = 16  # versions one publisher lists under one name (publishing drops the oldest beyond)
MAX_VERSION_NUMBER = 10**9
VERSION_PATTERN = re.compile(r"[0-9]{1,9}")
MAX_LIST_KEYS = 4


def versions_key(prefix: str, name: str) -> str:
    return adapter_versions_key(prefix, name)


def own_versions_key(prefix: str, name: str, author: str) -> str:
    """Where only the key with id ``author`` lists its versions of ``name``."""
    return ADAPTER_VERSIONS_OWN.key(prefix=prefix, name=name, signer=author)


@dataclass(frozen=True)
class AdapterVersion:
    """One version of a name (see the module doc)."""

    number: int
    sha256: str  # the files' content hash (swarm.adapters.sharing.content_hash): the version's identity
    size: int
    parent: Optional[str]  # the content hash it was trained from (None: from scratch)
    data: str  # sha256 (hex) of the data it saw
    score: Optional[float] = None  # the publisher's own held-out figure (a claim: adoption reads auditors only)
    published: float = 0.0  # the publisher's clock
    withdrawn: bool = False

    def to_value(self) -> list[Any]:
        return [self.number, self.sha256, self.size, self.parent, self.data, self.score, self.published,
                self.withdrawn]

    @classmethod
    def from_value(cls, raw: Any) -> "AdapterVersion":
        """One entry, every field checked; ValueError saying why not."""
        if not isinstance(raw, list) or len(raw) != 8:
            raise ValueError("a version is a list of 8 fields")
        number, sha, size, parent, data, score, published, withdrawn = raw
        if not is_sha256_hex(sha) or not is_sha256_hex(data) or not (parent is None or is_sha256_hex(parent)):
            raise ValueError("a version's content, parent and data digests are 64 hex digits")
        return cls(fields.integer(number, 1, MAX_VERSION_NUMBER), sha, fields.integer(size, 1), parent, data,
                   None if score is None else fields.number(score, -MAX_SCORE, MAX_SCORE),
                   fields.number(published, 0.0, 1e11), fields.flag(withdrawn))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class VersionList:
    """A publisher's versions of one name, oldest first."""

    name: str
    versions: tuple[AdapterVersion, ...]
    author: str = ""  # the signing key (base64), filled in from the slot when read

    def payload(self) -> bytes:
        """The signed bytes; ValueError when over the bounds readers enforce (count, size)."""
        check_order(self.versions)
        payload = MSGPackSerializer.dumps({"record_version": RECORD_VERSION, "name": self.name,
                                           "versions": [v.to_value() for v in self.versions]})
        if len(payload) > MAX_ADAPTER_VERSIONS_BYTES:
            raise ValueError(f"a version list of {len(payload)} bytes is over {MAX_ADAPTER_VERSIONS_BYTES}")
        return payload

    @classmethod
    def from_payload(cls, payload: Any, author: str) -> "VersionList":
        """Parse a verified payload, bounded; ValueError for anything else (its publisher may be hostile)."""
        body = fields.record_body(payload, MAX_ADAPTER_VERSIONS_BYTES, RECORD_VERSION, MAX_LIST_KEYS, "a version list")
        raw = body.get("versions")
        if not isinstance(raw, list) or len(raw) > MAX_VERSIONS:
            raise ValueError(f"versions must be a list of at most {MAX_VERSIONS} entries")
        versions = tuple(AdapterVersion.from_value(entry) for entry in raw)
        check_order(versions)
        return cls(check_name(body.get("name")), versions, author)

    def get(self, number: int) -> Optional[AdapterVersion]:
        return next((v for v in self.versions if v.number == number), None)

    def by_content(self, sha256: str) -> Optional[AdapterVersion]:
        return next((v for v in self.versions if v.sha256 == sha256), None)

    @property
    def live(self) -> list[AdapterVersion]:
        """The versions not withdrawn, oldest first."""
        return [v for v in self.versions if not v.withdrawn]

    @property
    def latest(self) -> Optional[AdapterVersion]:
        live = self.live
        return live[-1] if live else None

    def is_withdrawn(self, sha256: str) -> bool:
        version = self.by_content(sha256)
        return version is not None and version.withdrawn


def check_order(versions: tuple[AdapterVersion, ...] | list[AdapterVersion]) -> None:
    """Numbers strictly increasing, each content listed once, at most :data:`MAX_VERSIONS`; ValueError otherwise."""
    if len(versions) > MAX_VERSIONS:
        raise ValueError(f"at most {MAX_VERSIONS} versions per name, not {len(versions)}")
    numbers = [v.number for v in versions]
    if any(a >= b for a, b in zip(numbers, numbers[1:])):
        raise ValueError("version numbers must increase")
    if len({v.sha256 for v in versions}) != len(versions):
        raise ValueError("a content is listed as two versions")


# ----- references --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reference:
    """What a client asked for: ``NAME``, ``NAME@AUTHOR``, ``NAME@VERSION`` or ``NAME@AUTHOR@VERSION``."""

    name: str
    author: Optional[str] = None  # 16 hex digits
    version: Optional[int] = None

    @classmethod
    def parse(cls, reference: str) -> "Reference":
        name, *rest = reference.split("@")
        if len(rest) > 2:
            raise AdapterError(f"adapter reference {reference!r}: NAME, NAME@AUTHOR, NAME@VERSION or "
                               "NAME@AUTHOR@VERSION")
        author = rest[0] if len(rest) == 2 or (rest and not VERSION_PATTERN.fullmatch(rest[0])) else None
        version = rest[-1] if rest and rest[-1] is not author else None
        if author is not None and not AUTHOR_PATTERN.fullmatch(author) or (
                version is not None and not VERSION_PATTERN.fullmatch(version)):
            raise AdapterError(f"adapter reference {reference!r}: after NAME come an author id (16 lowercase hex "
                               "digits, as python -m swarm.health lists) and/or a version number")
        version = None if version is None else int(version)
        if version is not None and version < 1:
            raise AdapterError(f"adapter reference {reference!r}: versions count from 1")
        return cls(check_name(name), author, version)

    def __str__(self) -> str:
        return "@".join([self.name, *([self.author] if self.author else []),
                         *([str(self.version)] if self.version is not None else [])])


# ----- on the DHT ----------------------------------------------------------------------------------------
def read_versions(dht: DHT, prefix: str, name: str, authors: Iterable[str] = ()) -> list[VersionList]:
    """Every publisher's validly signed version list of ``name``: those of ``authors`` (ids) under their own keys, and
    those of the shared key (the first :data:`~swarm.dht.schema.MAX_ADAPTER_VERSION_PUBLISHERS`); per publisher the
    list reaching the highest version number. One read."""
    own = {own_versions_key(prefix, name, author): author for author in authors}
    lists: dict[str, VersionList] = {}
    for signer, payload in signed_entries(dht, versions_key(prefix, name), own):
        try:
            listed = VersionList.from_payload(payload, signer)
        except Exception as error:  # remote input: whatever went wrong, it is not a list
            logger.debug("ignoring a malformed version list under %r: %s", name, str(error)[:200])
            continue
        held = lists.get(signer)
        if listed.name != name or (held is None and len(lists) >= MAX_ADAPTER_VERSION_PUBLISHERS + len(own)):
            continue  # a list signed for another name cannot be moved here
        if held is None or _last_number(listed) > _last_number(held):
            lists[signer] = listed
    return list(lists.values())


def _last_number(listed: VersionList) -> int:
    return listed.versions[-1].number if listed.versions else 0


def own_versions(dht: DHT, prefix: str, name: str, public_key: str) -> VersionList:
    return next((v for v in read_versions(dht, prefix, name, [author_id(public_key)]) if v.author == public_key),
                VersionList(name, ()))


def store_versions(dht: DHT, key: Ed25519PrivateKey, prefix: str, listed: VersionList,
                   lifetime: float = PUBLISH_LIFETIME) -> VersionList:
    """Sign and store ``listed`` in ``key``'s slot under its own key (and the shared one, for older readers); the list
    as other peers return it from the own key, or :class:`AdapterError`."""
    own = ed25519_text(key)
    keys = [own_versions_key(prefix, listed.name, author_id(own)), versions_key(prefix, listed.name)]
    expiration = get_dht_time() + lifetime
    for dht_key in keys:
        store_slot(dht, key, dht_key, listed.payload(), expiration)
    forget_local_copies(dht, keys)  # what readers get, not this peer's own copy
    found = [payload for _, payload in signed_entries(dht, None, {keys[0]: author_id(own)})]
    if not found or VersionList.from_payload(found[0], own).versions != listed.versions:
        raise AdapterError(f"the swarm did not keep the version list of {listed.name!r}")
    return VersionList.from_payload(found[0], own)


def version_record(head: PublishedAdapter, version: AdapterVersion) -> PublishedAdapter:
    """The name record as it was for ``version``: its content, size and figure (base and author from ``head``)."""
    training = {**head.training, "version": version.number, "parent": version.parent or "", "data": version.data}
    return dataclasses.replace(head, sha256=version.sha256, size=version.size, score=version.score,
                               training=dict(list(training.items())[-32:]), published=version.published)


def publish_version(dht: DHT, key: Ed25519PrivateKey, prefix: str, directory: str | Path, name: str,
                    data: str, score: Optional[float] = None, served_by: tuple[str, ...] | list[str] = (),
                    keep: int = MAX_VERSIONS, lifetime: float = PUBLISH_LIFETIME) -> tuple[PublishedAdapter,
                                                                                          AdapterVersion]:
    """Publish the adapter in ``directory`` as the next version of ``name`` (its parent: the latest live one) and
    point the name record at it; the oldest versions beyond ``keep`` are dropped from the list. Returns the stored
    name record and the version. Publishing the content of a listed version again is refused."""
    if not 1 <= keep <= MAX_VERSIONS:
        raise AdapterError(f"keep must be 1-{MAX_VERSIONS} versions")
    if not is_sha256_hex(data):
        raise AdapterError("the data digest is a sha256 (64 lowercase hex digits)")
    record = make_record(directory, name, score, list(served_by))
    listed = own_versions(dht, prefix, name, ed25519_text(key))
    if listed.by_content(record.sha256) is not None:
        raise AdapterError(f"{name!r} already lists this content as version {listed.by_content(record.sha256).number}")
    latest = listed.latest
    number = (listed.versions[-1].number + 1) if listed.versions else 1
    version = AdapterVersion(number, record.sha256, record.size, latest.sha256 if latest else None, data, score,
                             time.time())
    listed = VersionList(name, (*listed.versions, version)[-keep:])
    store_versions(dht, key, prefix, listed, lifetime)
    stored = publish(dht, key, prefix, version_record(record, version), lifetime)
    logger.info("published %s version %d (sha256 %s, parent %s, data %s, own figure %s)", name, number,
                record.sha256[:12], (version.parent or "-")[:12], data[:12], score)
    return stored, version


def withdraw_version(dht: DHT, key: Ed25519PrivateKey, prefix: str, name: str, number: int,
                     lifetime: float = PUBLISH_LIFETIME) -> VersionList:
    """Mark the publisher's version ``number`` of ``name`` withdrawn (clients stop using it, ``best:`` never picks it)
    and point the name record back at the newest version left; the stored list."""
    own = ed25519_text(key)
    listed = own_versions(dht, prefix, name, own)
    if listed.get(number) is None:
        raise AdapterError(f"{name!r} has no version {number} by this key (it lists "
                           f"{[v.number for v in listed.versions]})")
    versions = tuple(dataclasses.replace(v, withdrawn=True) if v.number == number else v for v in listed.versions)
    stored = store_versions(dht, key, prefix, VersionList(name, versions), lifetime)
    head = next((r for r in read_published(dht, prefix, name, [author_id(own)]) if r.author == own), None)
    if head is not None and stored.latest is not None and head.sha256 != stored.latest.sha256:
        publish(dht, key, prefix, version_record(head, stored.latest), lifetime)
    logger.info("withdrew %s version %d", name, number)
    return stored


# ----- resolving ---------------------------------------------------------------------------------------
def withdrawals(lists: Iterable[VersionList]) -> dict[str, set[str]]:
    """{content hash: the publishers (ids) who withdrew it} over ``lists``."""
    withdrawn: dict[str, set[str]] = {}
    for listed in lists:
        for version in listed.versions:
            if version.withdrawn:
                withdrawn.setdefault(version.sha256, set()).add(author_id(listed.author))
    return withdrawn


def is_withdrawn(record: PublishedAdapter, withdrawn: Mapping[str, set[str]],
                 trusted: frozenset[str] = frozenset()) -> bool:
    """Whether ``record``'s content is withdrawn for a reader trusting the publishers ``trusted`` (ids): by its own
    publisher or a trusted one; by anyone at all for a reader that trusts none (see the module doc)."""
    by = withdrawn.get(record.sha256, set())
    return bool(by) and (not trusted or record.author_id in by or bool(by & trusted))


def name_versions(dht: DHT, prefix: str, name: str, authors: Iterable[str] = ()
                  ) -> tuple[dict[str, PublishedAdapter], list[VersionList]]:
    """The name records of ``name`` by publisher (``authors``' own keys read too) and the version lists of each."""
    heads = {record.author: record for record in read_published(dht, prefix, name, authors)}
    lists = read_versions(dht, prefix, name, sorted({author_id(author) for author in heads}))
    return heads, [listed for listed in lists if listed.author in heads]


def live_records(dht: DHT, prefix: str, name: str, authors: Iterable[str] = (),
                 trusted: frozenset[str] = frozenset()) -> list[PublishedAdapter]:
    """Every live version of ``name``, by every publisher, as records (with its number in ``training``); a name
    published without versions counts as its one record. No content withdrawn by any publisher of the name (for a
    reader trusting ``trusted``: :func:`is_withdrawn`)."""
    heads, lists = name_versions(dht, prefix, name, authors)
    return [r for r in _records(heads, lists) if not is_withdrawn(r, withdrawals(lists), trusted)]


def _records(heads: Mapping[str, PublishedAdapter], lists: Iterable[VersionList]) -> list[PublishedAdapter]:
    """Every version listed (those of a publisher with a name record) and the name records without versions."""
    heads, records = dict(heads), []
    for listed in lists:
        head = heads.pop(listed.author, None)
        if head is None:
            continue  # versions without a name record: nothing says which base model they are for
        records.extend(version_record(head, version) for version in listed.versions)
    return records + list(heads.values())  # publishers without versions


def published_versions(dht: DHT, prefix: str, max_names: int, trusted: frozenset[str] = frozenset()
                       ) -> list[PublishedAdapter]:
    """Every live version of the names the index lists (at most ``max_names``: the ``trusted`` publishers' first,
    then a fair sample, ``swarm.adapters.sharing.catalog_names``), no content withdrawn by a publisher whose withdrawal
    counts under any name read (:func:`is_withdrawn`)."""
    records, lists = [], []
    for name, authors in names_with_authors(catalog_names(dht, prefix, max_names, trusted)).items():
        heads, listed = name_versions(dht, prefix, name, authors)
        records += _records(heads, listed)
        lists += listed
    withdrawn = withdrawals(lists)
    return [record for record in records if not is_withdrawn(record, withdrawn, trusted)]


def version_number(record: PublishedAdapter) -> Optional[int]:
    number = record.training.get("version")
    return number if isinstance(number, int) and not isinstance(number, bool) else None


def reference_of(record: PublishedAdapter) -> str:
    """``name@AUTHOR@VERSION`` (or ``name@AUTHOR`` for a record without versions): exactly this content."""
    number = version_number(record)
    return f"{record.name}@{record.author_id}" + (f"@{number}" if number is not None else "")


def resolve(dht: DHT, prefix: str, reference: str) -> PublishedAdapter:
    """The record a reference names (see :class:`Reference`); :class:`AdapterError` for none, a withdrawn version, or
    several publishers without ``@AUTHOR``."""
    wanted = Reference.parse(reference)
    by_author, every_list = name_versions(dht, prefix, wanted.name, [wanted.author] if wanted.author else [])
    heads = [r for r in by_author.values() if wanted.author is None or r.author_id == wanted.author]
    lists = {listed.author: listed for listed in every_list}
    withdrawn = withdrawals(every_list)  # by any publisher of the name: the content, not one list, is withdrawn
    if len({r.author for r in heads}) > 1:
        authors = ", ".join(sorted(f"{r.name}@{r.author_id}" for r in heads))
        raise AdapterError(f"several authors published {wanted.name!r}: choose one of {authors}")
    if not heads:
        raise AdapterError(f"no adapter is published under {reference!r} (not a directory either); "
                           "python -m swarm.health lists published adapters")
    head = heads[0]
    listed = lists.get(head.author, VersionList(head.name, ()))
    if wanted.version is None:
        if is_withdrawn(head, withdrawn):
            raise AdapterError(f"{reference!r} holds content that a publisher of {wanted.name!r} withdrew")
        return head
    version = listed.get(wanted.version)
    if version is None:
        raise AdapterError(f"{reference!r}: no version {wanted.version} (versions listed: "
                           f"{[v.number for v in listed.versions] or 'none'})")
    if version.withdrawn:
        raise AdapterError(f"{reference!r}: version {wanted.version} was withdrawn by its publisher")
    if is_withdrawn(version_record(head, version), withdrawn):
        raise AdapterError(f"{reference!r}: version {wanted.version} holds content that another publisher of "
                           f"{wanted.name!r} withdrew")
    return version_record(head, version)


def fetch_reference(dht: DHT, prefix: str, reference: str, base: dict[str, Any], cache_dir: Path,
                    fetch: Fetch) -> Path:
    """The directory of the adapter ``reference`` names, its files checked against the record's content hash."""
    return fetch_record(dht, prefix, resolve(dht, prefix, reference), reference, base, cache_dir, fetch)
