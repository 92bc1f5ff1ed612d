"""Every DHT key the swarm stores or reads, declared once, with what it may hold.

A key *family* is a template such as ``{prefix}.adapters.{name}`` and a policy: which subkeys its keys take (records
of proven peer ids, ``owned``, or Ed25519 signed slots, ``slot``), how many and how big, and how far ahead an entry
may expire. The code builds a DHT key only with :meth:`KeyFamily.key` (``tests/test_dht_keys.py`` walks every DHT
read and store of ``swarm/`` and fails on a key built any other way), so this module lists every key there is.

Storing peers see only the hash of a key, and most keys hold a name or a digest known only to their readers: a peer
cannot tell a key of the swarm from anybody's. So every value the swarm stores *names its key*
(``swarm.dht.validation.describe``): a storing peer checks that the name hashes to the key, finds the name's family
(:func:`policy_for`) and from then on keeps under that key only what the family allows, dropping what it took before
while the key looked like anybody's (a flood of plain subkeys stored before the first honest record). A value that
names a key of no family, or another key than its own, is refused.

Declaring a key (one line here, then build it with ``FAMILY.key(part=...)``)::

    ADAPTER_VERSIONS = declare("versions of an adapter name", "{prefix}.adapter-versions.{name}", SLOT,
                               max_value_bytes=2 * 1024, max_subkeys=32, max_lifetime=NAME_LIFETIME, trust=PREFER)

Parts are those of :data:`PARTS`. The literal text of a template must tell it apart from every other (names may
hold dots: ``{prefix}.adapters.versions.{name}`` would be read as an adapter name), and its entries must fit one reply
at their bounds: :func:`declare` refuses a family whose ``max_subkeys`` full entries exceed what a reply carries, and
the tests fail when two families match one key.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, Optional

from swarm.dht.config import MAX_AUDIT_LIFETIME, MAX_OWNED_LIFETIME
from swarm.dht.stamp import required_bits
from swarm.dht.validation import ENTRY_OVERHEAD_BYTES, MAX_KEY_BYTES, OWNED, SLOT, KeyPolicy
from swarm.utils.errors import SwarmError

# What a part of a key may be. Prefixes hold no dot, so ``{prefix}.`` always ends where the family's text begins.
PARTS: dict[str, str] = {
    "prefix": r"[A-Za-z0-9_-]{1,128}",  # a model directory's name as default_prefix cleans it, or --dht-prefix
    "block": r"[0-9]{1,5}",
    "name": r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}",
    "sha256": r"[0-9a-f]{64}",
    "auditor": r"[A-Za-z0-9+/]{43}=",  # an Ed25519 public key, base64
    "coordinator": r"[A-Za-z0-9+/]{43}=",  # a stream coordinator's Ed25519 public key, base64
    "signer": r"[0-9a-f]{16}",  # an Ed25519 key's id (swarm.dht.validation.signer_id): what NAME@PUBLISHER names
}
# The room a subkey of each kind takes in a reply: an owner subkey is a peer id and an RSA public key (a 2048-bit key
# takes about 430 bytes, a 4096-bit one about 780).
SUBKEY_ROOM = {OWNED: 900, SLOT: 64}
# Trust: ANY keeps the first entries that fit; PREFER also makes room for a slot of a key the storing peer trusts
# (its governance keys) by dropping the newest slot of an untrusted key; ONLY keeps slots of trusted keys alone
# (any slot while the peer trusts none).
ANY, PREFER, ONLY = "any", "prefer", "only"

DAY = 24 * 3600.0
NAME_LIFETIME = 31 * DAY  # published names live 30 days (swarm.weights.limits, swarm.adapters.limits): a day's skew
DECISION_LIFETIME = 31 * DAY  # a governance decision is stored for 30 days (swarm.governance.records)


class KeyPartError(SwarmError, ValueError):
    """A key part that does not fit its family (a prefix with a dot, a name too long...)."""


@dataclass(frozen=True)
class KeyFamily:
    """A template of DHT keys and what each of them may hold (see the module's docstring)."""

    label: str
    template: str
    kind: str
    max_value_bytes: int  # one entry's value as stored (hivemind's RSA signature and the key's name included)
    max_subkeys: int  # entries one storing peer keeps under one key
    max_lifetime: float  # seconds ahead an entry may expire
    trust: str = ANY
    signer_part: Optional[str] = None  # the part naming the one Ed25519 key whose slot the key takes (or its id)
    stamped: bool = False  # a shared list: each slot carries a work stamp (swarm.dht.stamp)

    @cached_property
    def pattern(self) -> re.Pattern:
        regex, position = "", 0
        for match in re.finditer(r"\{(\w+)\}", self.template):
            regex += re.escape(self.template[position:match.start()]) + f"(?P<{match[1]}>{PARTS[match[1]]})"
            position = match.end()
        return re.compile(regex + re.escape(self.template[position:]))

    def key(self, **parts: Any) -> str:
        """The key of these parts; :class:`KeyPartError` for a part that does not fit (every key is made here)."""
        key = self.template.format(**{name: str(value) for name, value in parts.items()})
        if self.pattern.fullmatch(key) is None:
            raise KeyPartError(f"no {self.label} key can be made of {parts!r} ({self.template}; parts: "
                            + ", ".join(f"{p} {PARTS[p]}" for p in re.findall(r"\{(\w+)\}", self.template)) + ")")
        return key

    def parts(self, key: str) -> Optional[dict[str, str]]:
        match = self.pattern.fullmatch(key)
        return match.groupdict() if match else None

    def policy(self, key: str, trusted: frozenset[str] = frozenset()) -> KeyPolicy:
        """What ``key`` (of this family) may hold at a peer trusting the Ed25519 keys ``trusted`` (base64)."""
        parts = self.parts(key)
        if parts is None:
            raise KeyPartError(f"{key!r} is no {self.label} key ({self.template})")
        signers, signer_id, count = None, None, self.max_subkeys
        if self.signer_part == "signer":
            signer_id, count = parts["signer"], 1
        elif self.signer_part is not None:
            signers, count = frozenset({parts[self.signer_part]}), 1
        elif self.trust == ONLY and trusted:
            signers, count = frozenset(trusted), min(len(trusted), self.max_subkeys)
        return KeyPolicy(key, self.kind, self.max_value_bytes, count, signers, self.max_lifetime,
                         trusted=frozenset(trusted) if self.trust == PREFER else frozenset(),
                         max_subkey_bytes=SUBKEY_ROOM[self.kind], signer_id=signer_id,
                         stamp_bits=required_bits() if self.stamped else 0)


FAMILIES: list[KeyFamily] = []


def entries_fit(kind: str, max_value_bytes: int, max_subkeys: int) -> bool:
    """Whether ``max_subkeys`` entries at the bounds fit what one reply carries for one key."""
    return max_subkeys * (max_value_bytes + SUBKEY_ROOM[kind] + ENTRY_OVERHEAD_BYTES) <= MAX_KEY_BYTES


def declare(label: str, template: str, kind: str, max_value_bytes: int, max_subkeys: int, max_lifetime: float,
            trust: str = ANY, signer_part: Optional[str] = None, stamped: bool = False) -> KeyFamily:
    """Declare a key family (once, in this module); ValueError for one whose full entries would not fit a reply."""
    if not entries_fit(kind, max_value_bytes, max_subkeys):
        raise ValueError(f"{label}: {max_subkeys} entries of {max_value_bytes} bytes exceed one key's "
                         f"{MAX_KEY_BYTES} bytes")
    family = KeyFamily(label, template, kind, max_value_bytes, max_subkeys, max_lifetime, trust, signer_part, stamped)
    FAMILIES.append(family)
    return family


# ----- the keys -------------------------------------------------------------------------------------------------
# A server's record under each block of its span (swarm.dht.schema); a record with every field at its bound is 4.8 KiB.
BLOCK = declare("block", "{prefix}.{block}", OWNED, 6 * 1024, 32, MAX_OWNED_LIFETIME)
# Each expert-hosting server's list of experts (swarm.dht.schema).
EXPERTS = declare("expert index", "{prefix}.experts", OWNED, 6 * 1024, 32, MAX_OWNED_LIFETIME)
# Signed halt / resume decisions (swarm.governance.records): a reason is cut to 512 characters. Each key's decisions
# live under its own key (the one slot its key may write, whatever the storing peer trusts); the shared key, where a
# peer that trusts no key keeps the first slots that came, is written too, for readers before issue 55.
GOVERNANCE = declare("governance", "{prefix}.governance", SLOT, 2 * 1024, 64, DECISION_LIFETIME, trust=ONLY)
GOVERNANCE_OWN = declare("one key's governance", "{prefix}.governance.{signer}", SLOT, 2 * 1024, 1, DECISION_LIFETIME,
                         signer_part="signer")
# One auditor's signed report (swarm.reports.records): the key names the one key that may sign it.
AUDIT = declare("audit report", "{prefix}.audits.{auditor}", SLOT, 16 * 1024 + 512, 1, MAX_AUDIT_LIFETIME,
                signer_part="auditor")
# One stream coordinator's signed record of the domain streams (swarm.improve.stream_records): the key names the one
# key that may sign it, as an audit report's does (issue 55: nothing shared is fillable for free).
STREAMS = declare("stream record", "{prefix}.streams.{coordinator}", SLOT, 16 * 1024 + 512, 1, MAX_AUDIT_LIFETIME,
                  signer_part="coordinator")
# Where a reader needs one signer's entry, the signer's id is part of the key (issue 55): the one slot its key may
# write, which no flood of other keys can take. The shared keys beside them list who writes (a name's publishers,
# the authors of a prefix): readers read them through their trust first, then a fair sample (swarm.dht.sample).
# Each adapter author's list of names (swarm.adapters.sharing): 64 names of 64 characters at most; shared, and its own.
ADAPTER_INDEX = declare("adapter index", "{prefix}.adapters", SLOT, 6 * 1024, 32, NAME_LIFETIME, trust=PREFER,
                        stamped=True)
ADAPTER_INDEX_OWN = declare("one author's adapter index", "{prefix}.adapter-index.{signer}", SLOT, 6 * 1024, 1,
                            NAME_LIFETIME, signer_part="signer")
# A published adapter: each author's record in its slot (swarm.adapters.sharing); shared, and its own.
ADAPTER_NAME = declare("adapter name", "{prefix}.adapters.{name}", SLOT, 8 * 1024, 24, NAME_LIFETIME, trust=PREFER,
                       stamped=True)
ADAPTER_NAME_OWN = declare("one author's adapter name", "{prefix}.adapters.{name}@{signer}", SLOT, 8 * 1024, 1,
                           NAME_LIFETIME, signer_part="signer")
# Each publisher's list of an adapter name's versions (swarm.adapters.versions): 16 versions in 6 KiB at most. The
# shared key is read only for lists written before issue 55; publishers write their own.
ADAPTER_VERSIONS = declare("adapter versions", "{prefix}.adapter-versions.{name}", SLOT, 6 * 1024, 32, NAME_LIFETIME,
                           trust=PREFER, stamped=True)
ADAPTER_VERSIONS_OWN = declare("one publisher's adapter versions", "{prefix}.adapter-versions.{name}@{signer}", SLOT,
                               6 * 1024, 1, NAME_LIFETIME, signer_part="signer")
# Servers serving an adapter's files, by content hash (swarm.adapters.sharing).
ADAPTER_HOSTS = declare("adapter hosts", "{prefix}.adapter-hosts.{sha256}", OWNED, 4 * 1024, 32, MAX_OWNED_LIFETIME)
# A published model name: each publisher's record in its slot (swarm.weights.records).
WEIGHTS_NAME = declare("model name", "swarm-weights:name:{name}", SLOT, 1024, 64, NAME_LIFETIME, trust=PREFER,
                       stamped=True)
WEIGHTS_NAME_OWN = declare("one publisher's model name", "swarm-weights:name:{name}@{signer}", SLOT, 1024, 1,
                           NAME_LIFETIME, signer_part="signer")
# Peers serving a model id's bytes (swarm.weights.records): a record holds a bitmap of up to 100,000 tensors.
WEIGHTS_HOSTS = declare("model hosts", "swarm-weights:hosts:{sha256}", OWNED, 16 * 1024, 13, MAX_OWNED_LIFETIME)


def family_of(key: str) -> Optional[KeyFamily]:
    """The family ``key`` belongs to (templates are disjoint: tested), or None."""
    return next((family for family in FAMILIES if family.parts(key) is not None), None)


def policy_for(key: str, trusted: frozenset[str] = frozenset()) -> Optional[KeyPolicy]:
    """What ``key`` may hold at a peer trusting ``trusted``, or None for a key of no family (hivemind's own)."""
    family = family_of(key) if isinstance(key, str) else None
    return family.policy(key, trusted) if family is not None else None


def trusted_keys(policies: Iterable[KeyPolicy]) -> frozenset[str]:
    """The Ed25519 keys a process trusts (base64), read from its policies: the governance keys its governance policies
    keep alone. Storing peers make room for these keys' slots under keys of :data:`PREFER` families."""
    return frozenset().union(*(policy.signers or () for policy in policies
                               if GOVERNANCE.parts(policy.name) is not None))
