"""Every DHT key under a policy, by construction (issue 48): the registry of key families (``swarm.dht.keys``), a
walk over the package that fails on any DHT read or store whose key is not built from it, and the storage that
learns a key's policy from the values that name it, fuzzed."""
from __future__ import annotations

import dataclasses
import textwrap
from functools import partial
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import MSGPackSerializer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.adapters.sharing import signed_value
from swarm.dht import keys
from swarm.dht.keys import FAMILIES, PARTS, KeyFamily, KeyPartError, declare, family_of, policy_for
from swarm.dht.schema import now, protected_keys
from swarm.dht.validation import (
    MAX_KEY_BYTES,
    MAX_KEY_SUBKEYS,
    OWNED,
    SLOT,
    describe,
    described_key,
    ed25519_text,
    entry_bytes,
    protect_storage,
    sign_slot,
    slot_subkey,
)
from tests.dht_key_walk import Walk, walk_package

ROOT = Path(__file__).resolve().parent.parent
FAMILY_NAMES = sorted(name for name, value in vars(keys).items() if isinstance(value, KeyFamily))


# ----- the walk: every key the code reads or stores is declared -------------------------------------------------
def test_every_dht_read_and_store_of_the_package_uses_a_declared_key():
    walk = walk_package(ROOT / "swarm", FAMILY_NAMES)
    assert walk.undeclared == [], "DHT keys not built with swarm.dht.keys (declare the key there):\n" + \
        "\n".join(walk.undeclared)
    sinks = {sink for _, _, sink in walk.sites}
    assert {"store", "get_many", "store_many", "store_slot", "store_owned", "read_owned", "signed_entries"} <= sinks, \
        f"the walk no longer sees the code's reads and stores: {sorted(sinks)}"
    assert len(walk.sites) >= 20
    unused = set(FAMILY_NAMES) - walk.families_used
    assert not unused, f"declared but never built: {unused}"
    assert all(value in FAMILIES for value in vars(keys).values() if isinstance(value, KeyFamily)), \
        "a family made without declare() is unknown to storing peers"


def test_the_walk_finds_a_key_built_outside_the_registry():
    source = textwrap.dedent('''
        def leak(dht, name):
            dht.store(f"swarm-weights:name:{name}", b"v", expiration_time=1.0)

        def wrapper(dht, key):
            return dht.get(key, latest=True)

        def through_a_wrapper(dht):
            key = "plain" + "key"
            wrapper(dht, key)

        def declared(dht, prefix):
            keys = [BLOCK.key(prefix=prefix, block=b) for b in range(3)]
            node.get_many(keys)
            wrapper(dht, WEIGHTS_NAME.key(name="x"))
        ''')
    walk = Walk({"BLOCK", "WEIGHTS_NAME"})
    walk.add_source("planted.py", source)
    walk.run()
    assert [line.split(":")[1] for line in walk.undeclared] == ["3", "10"], walk.undeclared
    assert walk.sinks["wrapper"] == ("key", 1)


# ----- the registry -------------------------------------------------------------------------------------------
def part_values(family: KeyFamily):
    names = [part for part in PARTS if "{" + part + "}" in family.template]
    return st.fixed_dictionaries({name: st.from_regex(PARTS[name], fullmatch=True) for name in names})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_key_belongs_to_exactly_one_family(data):
    family = data.draw(st.sampled_from(FAMILIES))
    key = family.key(**data.draw(part_values(family)))
    assert [f.label for f in FAMILIES if f.parts(key) is not None] == [family.label], key
    assert family_of(key) is family and policy_for(key).name == key


def test_keys_with_parts_that_do_not_fit_are_refused():
    for family, parts in [(keys.BLOCK, {"prefix": "with.dot", "block": 1}), (keys.WEIGHTS_NAME, {"name": "x" * 65}),
                          (keys.WEIGHTS_HOSTS, {"sha256": "AB" * 32}), (keys.AUDIT, {"prefix": "p", "auditor": "k"}),
                          (keys.ADAPTER_NAME, {"prefix": "p", "name": ".hidden"})]:
        with pytest.raises(KeyPartError):
            family.key(**parts)


def test_a_family_whose_entries_cannot_fit_one_reply_is_refused():
    count = len(FAMILIES)
    with pytest.raises(ValueError, match="exceed one key's"):
        declare("too big", "{prefix}.too-big", SLOT, 16 * 1024, 64, 60.0)
    assert len(FAMILIES) == count
    for family in FAMILIES:
        assert keys.entries_fit(family.kind, family.max_value_bytes, family.max_subkeys), family.label


def test_every_honest_writer_stays_within_its_family():
    """Records at their fields' bounds fit their family, and each writer's lifetime is within the family's bound."""
    from swarm.adapters.limits import PUBLISH_LIFETIME as ADAPTER_LIFETIME
    from swarm.adapters.sharing import MAX_NAMES_PER_AUTHOR
    from swarm.governance.records import RECORD_LIFETIME
    from swarm.weights.limits import PUBLISH_LIFETIME as WEIGHTS_LIFETIME
    from swarm.weights.records import PublishedModel

    signer, expiration = Ed25519PrivateKey.generate(), now() + 60
    name = "n" * 64
    record = PublishedModel(name, "f" * 64, 2**24, 2**50, 1e10)
    value = signed_value(signer, keys.WEIGHTS_NAME.key(name=name), record.payload(), expiration)  # with its stamp
    assert len(MSGPackSerializer.dumps(value)) <= keys.WEIGHTS_NAME.max_value_bytes
    names = MSGPackSerializer.dumps(["a" * 64] * MAX_NAMES_PER_AUTHOR)
    value = signed_value(signer, keys.ADAPTER_INDEX.key(prefix="p" * 64), names, expiration)
    assert len(MSGPackSerializer.dumps(value)) <= keys.ADAPTER_INDEX.max_value_bytes
    assert max(WEIGHTS_LIFETIME, ADAPTER_LIFETIME) <= keys.NAME_LIFETIME
    assert RECORD_LIFETIME <= keys.DECISION_LIFETIME


# ----- the storage, fuzzed ---------------------------------------------------------------------------------
SIGNERS = [Ed25519PrivateKey.generate() for _ in range(6)]
TRUSTED = SIGNERS[0]
SMALL_BOUND = 3  # the fuzzed policies keep 3 entries, so that few signers fill them


def small(policy):
    return None if policy is None else dataclasses.replace(policy, max_subkeys=min(policy.max_subkeys, SMALL_BOUND))


def fuzzed_storage() -> DHTLocalStorage:
    storage = DHTLocalStorage()
    resolve = partial(policy_for, trusted=frozenset({ed25519_text(TRUSTED)}))
    protect_storage([storage], {}, lambda key: small(resolve(key)))
    return storage


OPS = st.one_of(
    st.tuples(st.just("plain"), st.binary(max_size=8), st.binary(max_size=64)),
    st.tuples(st.just("regular"), st.binary(max_size=64), st.floats(1, 10**8)),
    st.tuples(st.just("slot"), st.integers(0, len(SIGNERS) - 1), st.booleans()),  # bool: names its key
    st.tuples(st.just("misnamed"), st.integers(0, len(SIGNERS) - 1), st.just(0)),
    st.tuples(st.just("raw"), st.binary(max_size=16), st.binary(max_size=300)),  # any bytes under any subkey
)


# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([keys.WEIGHTS_NAME.key(name="fuzzed"), keys.ADAPTER_NAME.key(prefix="p", name="n"),
                        keys.GOVERNANCE.key(prefix="p")]), st.lists(OPS, max_size=25))
def test_no_sequence_of_stores_hides_a_named_key_or_keeps_what_its_policy_refuses(key, ops):
    """Any stores under a key that looks like anybody's until a value names it: once one does, the key holds only
    values naming it that its policy allows (no plain subkey, no regular value) and at most its bound; a slot of the
    trusted key is always taken; and every key stays within what a reply carries."""
    storage, key_id = fuzzed_storage(), DHTID.generate(source=key)
    policy = small(policy_for(key, frozenset({ed25519_text(TRUSTED)})))
    learnt = False
    for step, (kind, a, b) in enumerate(ops):
        expiration = now() + 600 + step  # each write later than the last: an update of a held subkey is newer
        if kind == "plain":
            storage.store_subkey(key_id, a, b, expiration)
        elif kind == "regular":
            storage.store(key_id, a, now() + b)
        elif kind == "raw":
            storage.store_subkey(key_id, a, MSGPackSerializer.dumps(describe(key, {"x": b})), expiration)
        else:
            signer = SIGNERS[a]
            value = signed_value(signer, key, b"payload", expiration)
            if kind == "misnamed":
                value = describe("another.governance", value)
            elif not b:
                value.pop("dht_key")
            stored = storage.store_subkey(key_id, slot_subkey(signer), MSGPackSerializer.dumps(value), expiration)
            learnt = learnt or (kind == "slot" and b and stored)
            if kind == "slot" and b and signer is TRUSTED:
                assert stored, "a slot of the trusted key was refused"
            if kind == "misnamed" or (learnt and not b):
                assert not stored, "a value not naming this key was stored"
        learnt = learnt or storage.policy_of(key_id.to_bytes()) is not None
        held = storage.get(key_id)
        if held is None:
            continue
        if learnt:
            assert isinstance(held.value, DictionaryDHTValue), "a regular value hides the key's records"
            assert len(held.value) <= policy.max_subkeys
            for subkey, item in held.value.items():
                assert described_key(item.value) == key and policy.refusal(subkey, len(item.value)) is None
        if isinstance(held.value, DictionaryDHTValue):
            assert len(held.value) <= MAX_KEY_SUBKEYS
            assert sum(entry_bytes(s, item.value) for s, item in held.value.items()) <= MAX_KEY_BYTES


def test_an_audit_key_takes_only_its_auditors_slot():
    """The auditor's key is part of the key: a storing peer that trusts no auditor still keeps that one slot alone."""
    auditor, other = SIGNERS[1], SIGNERS[2]
    key = keys.AUDIT.key(prefix="p", auditor=ed25519_text(auditor))
    storage, key_id, expiration = fuzzed_storage(), DHTID.generate(source=key), now() + 600

    def store(signer) -> bool:
        value = MSGPackSerializer.dumps(sign_slot(signer, key, b"report", expiration))
        return storage.store_subkey(key_id, slot_subkey(signer), value, expiration)

    assert store(other) is False and store(auditor) is True and store(other) is False


def test_listed_and_learnt_policies_agree():
    """A key a process lists in advance (its model's keys) and one it learns from a value get the same policy."""
    trusted = frozenset({ed25519_text(TRUSTED)})
    for policy in protected_keys("model", 2, trusted):
        assert policy_for(policy.name, trusted) == policy
    assert all(family.kind in (OWNED, SLOT) for family in FAMILIES)


def test_a_full_name_makes_room_for_the_trusted_key_and_refuses_strangers():
    """Fresh keys' slots fill a name to its bound: one more stranger is refused, the trusted key's slot takes the place
    of the newest stranger's, and an update of a held slot passes."""
    key = keys.WEIGHTS_NAME.key(name="crowded")
    storage, key_id = fuzzed_storage(), DHTID.generate(source=key)

    def store(signer, when: float) -> bool:
        value = MSGPackSerializer.dumps(signed_value(signer, key, b"record", when))
        return storage.store_subkey(key_id, slot_subkey(signer), value, when)

    when = now() + 600
    strangers = SIGNERS[1:SMALL_BOUND + 2]
    assert [store(s, when) for s in strangers] == [True] * SMALL_BOUND + [False]
    assert store(TRUSTED, when) is True
    held = {subkey for subkey, _ in storage.get(key_id).value.items()}
    assert held == {slot_subkey(s) for s in strangers[:SMALL_BOUND - 1]} | {slot_subkey(TRUSTED)}
    assert store(strangers[0], when + 1) is True, "an update of a held slot must pass"
    assert store(strangers[SMALL_BOUND - 1], when + 1) is False, "a full key took a stranger"


# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None)
@given(st.one_of(st.binary(max_size=400), st.builds(lambda d: MSGPackSerializer.dumps(d), st.dictionaries(
    st.sampled_from(["dht_key", "payload", "x"]), st.one_of(st.text(max_size=300), st.binary(max_size=20),
                                                             st.integers(-2**63, 2**63 - 1), st.none()), max_size=3))),
       st.text(max_size=120))
def test_the_key_a_value_names_is_parsed_from_any_bytes_without_raising(stored, text):
    """What a storing peer reads from remote bytes: the key a value names (a bounded text or None), and the family
    of any text (None or the one family matching it), never an exception."""
    named = described_key(stored)
    assert named is None or (isinstance(named, str) and len(named) <= 256)
    signed = stored + b"[signature:" + stored[:8] + b"]"  # hivemind's RSA signature is stripped first
    assert described_key(signed) in (named, None)
    family = family_of(text)
    assert family is None or family.parts(text) is not None
    assert policy_for(text) is None or policy_for(text).name == text


# ----- issue 55, 1: no fallback to permissive, O(1) per store -------------------------------------------------------
def _store_named_slot(storage, key: str, signer=None, expiration: float = None) -> bool:
    signer = signer or SIGNERS[1]
    expiration = expiration or now() + 600
    value = MSGPackSerializer.dumps(signed_value(signer, key, b"record", expiration))
    return storage.store_subkey(DHTID.generate(source=key), slot_subkey(signer), value, expiration)


def test_a_key_named_after_a_flood_of_named_keys_stays_protected(monkeypatch):
    """The issue's attack at a small configured bound: a stranger makes a peer learn many keys (each slot naming its
    own key, the reader's table at its bound too); a key named afterwards keeps its policy while its record is held,
    so a regular value expiring in a year cannot replace the record, nor a plain subkey join it."""
    from swarm.dht import validation

    monkeypatch.setattr(validation, "MAX_READ_KEYS", 8)
    storage = fuzzed_storage()
    for i in range(2_000):
        assert _store_named_slot(storage, keys.WEIGHTS_NAME.key(name=f"flood-{i}"))
    for i in range(32):  # the reader's own table overflows too
        storage.learn(keys.WEIGHTS_NAME.key(name=f"read-{i}"))
    assert len(storage.reading) <= 8
    key = keys.WEIGHTS_NAME.key(name="published-after")
    key_id = DHTID.generate(source=key)
    assert _store_named_slot(storage, key, TRUSTED)
    assert storage.store(key_id, MSGPackSerializer.dumps(b"x"), now() + 365 * 24 * 3600) is False
    assert storage.store_subkey(key_id, b"plain", b"x", now() + 600) is False
    held = storage.get(key_id)
    assert isinstance(held.value, DictionaryDHTValue) and slot_subkey(TRUSTED) in held.value
    # the policy lives with the entries it protects: a dropped key leaves nothing behind
    del storage[key_id]
    assert storage.policy_of(key_id.to_bytes()) is None


def test_a_regular_value_naming_a_swarm_key_is_refused_before_the_key_is_known():
    """A swarm key never holds a regular value: one that names such a key is refused even where its policy is not
    known yet (it would otherwise block the key's first honest record)."""
    storage = fuzzed_storage()
    key = keys.ADAPTER_NAME.key(prefix="p", name="early")
    value = MSGPackSerializer.dumps(describe(key, {"payload": b"x"}))
    assert storage.store(DHTID.generate(source=key), value, now() + 3600) is False


class _NoScan(dict):
    """A storage table that fails any walk over it: a store may touch only the key it writes."""

    def _refuse(self, *args, **kwargs):
        raise AssertionError("a store walked the whole table")

    __iter__ = items = values = keys = _refuse


def test_no_store_walks_the_table():
    """Every store (a new key learnt from its value, an update, a refused one) costs the same whatever the table holds:
    none walks it (0.2-0.3 s per new key at 100,000 learnt keys, before)."""
    storage = fuzzed_storage()
    for i in range(200):
        _store_named_slot(storage, keys.WEIGHTS_NAME.key(name=f"held-{i}"))
    storage.data = _NoScan(storage.data)
    key = keys.WEIGHTS_NAME.key(name="new")
    assert _store_named_slot(storage, key)
    assert _store_named_slot(storage, key, expiration=now() + 700)
    assert storage.store(DHTID.generate(source=key), b"x", now() + 3600) is False
    assert storage.store_subkey(DHTID.generate(source="anybody's"), b"s", b"v", now() + 60)


# ----- issue 55, 2: a shared list admits a new entry for verifiable work --------------------------------------------
def test_a_shared_list_takes_a_slot_only_with_work_for_its_key_and_signer():
    """Shared lists (a name's publishers, a prefix's authors) ask a work stamp of each slot, made for that key and that
    signer: none, one made for another key or another signer, or one below the bits is refused; a valid one is taken,
    and reused for an update. What a key held unstamped before its policy was learnt is dropped then. Own keys (one
    signer's) ask none: no other key can write there."""
    from swarm.dht.stamp import STAMP_FIELD, make_stamp, required_bits
    from swarm.dht.validation import dht_key_id

    key, other = keys.WEIGHTS_NAME.key(name="stamped"), keys.WEIGHTS_NAME.key(name="elsewhere")
    bits = keys.WEIGHTS_NAME.policy(key).stamp_bits
    assert bits == required_bits() > 0
    assert keys.WEIGHTS_NAME_OWN.policy(keys.WEIGHTS_NAME_OWN.key(name="stamped", signer="0" * 16)).stamp_bits == 0
    storage, key_id, expiration = fuzzed_storage(), DHTID.generate(source=key), now() + 600
    signer, stranger = SIGNERS[1], SIGNERS[2]

    def store(stamp, when=expiration) -> bool:
        value = sign_slot(signer, key, b"record", when)
        if stamp is not None:
            value[STAMP_FIELD] = stamp
        return storage.store_subkey(key_id, slot_subkey(signer), MSGPackSerializer.dumps(value), when)

    # an unstamped slot taken while the key looked like anybody's (a value naming no key) ...
    assert storage.store_subkey(key_id, slot_subkey(stranger), MSGPackSerializer.dumps({"payload": b"x"}), expiration)
    assert store(None) is False
    assert store(make_stamp(dht_key_id(other), ed25519_text(signer), bits)) is False
    assert store(make_stamp(dht_key_id(key), ed25519_text(stranger), bits)) is False
    weak = next(n.to_bytes(8, "little") for n in range(10**6)
                if _stamp_bits(dht_key_id(key), ed25519_text(signer), n.to_bytes(8, "little")) < bits)
    assert store(weak) is False
    good = make_stamp(dht_key_id(key), ed25519_text(signer), bits)
    assert store(good) is True and store(good, expiration + 1) is True
    # ... is gone once the key's policy is known
    assert {subkey for subkey, _ in storage.get(key_id).value.items()} == {slot_subkey(signer)}


def _stamp_bits(key_id: bytes, signer: str, stamp: bytes) -> int:
    """The work a stamp proves, computed here from its definition (sha256 of domain, key, signer, nonce)."""
    import hashlib

    digest = hashlib.sha256(b"swarm-stamp-v1" + len(key_id).to_bytes(2, "big") + key_id + signer.encode() + stamp)
    value = int.from_bytes(digest.digest(), "big")
    return 256 - value.bit_length()
