"""Attacks on what readers get back from the DHT, by a peer with no key, against real processes (issue 33, 1-2).

A DHT get returns a key's whole subkey dictionary in one reply, and a reply over libp2p's 4 MiB message is lost.
An attacker who stores enough plain subkeys under a key the swarm reads blinds every reader of it (the kill switch
first). Peers that know the swarm's keys (``swarm.dht.schema.protected_keys``) refuse such writes; readers use the
other peers' replies and warn of the lost one; ``halt`` reports success only once readers read it back. And no
record, however signed, makes a reader raise or the health map print invalid JSON.
"""
from __future__ import annotations

import json
import os
import re
import signal
from functools import partial
from typing import Optional

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht import DHT, DHTNode
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.client import DistributedDiffusionLM
from swarm.dht.config import MAX_UPDATE_PERIOD
from swarm.dht.identity import Identity
from swarm.dht.node import NetworkConfig, start_dht, stop_dht, visible_maddrs
from swarm.dht.schema import (
    MAX_ADAPTER_AUTHORS,
    MAX_ADAPTER_INDEX_BYTES,
    MAX_DECISION_VALUE_BYTES,
    MAX_EXPERTS_PER_SERVER,
    MAX_OWNED_LIFETIME,
    MAX_OWNED_SUBKEYS,
    MAX_OWNED_VALUE_BYTES,
    MAX_UNTRUSTED_SLOTS,
    RECORD_VERSION,
    adapter_index_key,
    block_key,
    default_prefix,
    expert_index_key,
    forget_local_copies,
    governance_key,
    now,
    protected_keys,
    read_all_experts,
    read_servers,
)
from swarm.dht.stamp import STAMP_FIELD, make_stamp
from swarm.dht.validation import (
    MAX_KEY_BYTES,
    MAX_KEY_SUBKEYS,
    STORE_SENDER,
    describe,
    dht_key_id,
    ed25519_text,
    entry_bytes,
    protect_storage,
    slot_subkey,
)
from swarm.governance.__main__ import main as governance_cli
from swarm.governance.guard import GovernanceGuard
from swarm.governance.keys import generate_private_key, public_key_text, trusted_signers
from swarm.governance.records import HALT, RESUME, GovernanceState, publish
from swarm.health.__main__ import main as health_main
from swarm.server.config import ServerConfig
from tests.conftest import stop_all, wait_until
from tests.test_security_records import SETTINGS, attacker, forge, honest_peers, run_cli  # noqa: F401 (fixture)

FLOOD_VALUE = b"x" * 4096
FLOOD_COUNT = 1100  # 1,100 plain 4 KiB subkeys: a reply of ~4.5 MiB, just past libp2p's 4 MiB message
FLOOD_LIFETIME = 120.0  # what a peer keeps of the flood (up to MAX_KEY_BYTES on a swarm peer) stays this long
UNREAD_SECONDS = 1.0  # how long a publish that cannot be read back tries (one store and one read: enough to fail)


# ----- the attacker's flood (runs in its DHT process) ------------------------------------------------------
async def _flood(dht: DHT, node: DHTNode, key: str, peers: list[str], count: int, expiration: float) -> list:
    """Store ``count`` plain 4 KiB subkeys under ``key`` in the attacker's own storage and push them to each peer
    (in requests of 200, below the message limit); per peer, whether every batch was accepted."""
    key_id = DHTID.generate(source=key)
    value = MSGPackSerializer.dumps(FLOOD_VALUE)
    subkeys = [f"flood-{i}".encode() for i in range(count)]
    for subkey in subkeys:
        node.protocol.storage.store_subkey(key_id, subkey, value, expiration)
    accepted = []
    for peer in peers:
        answers = []
        for start in range(0, count, 200):
            batch = subkeys[start:start + 200]
            answer = await node.protocol.call_store(PeerID.from_base58(peer), [key_id] * len(batch),
                                                    [value] * len(batch), expiration, subkeys=batch)
            answers += answer or [False]
        accepted.append(all(answers))
    return accepted


def flood(attacker_dht: DHT, key: str, peers: list[str], count: int = FLOOD_COUNT) -> list:
    return attacker_dht.run_coroutine(partial(_flood, key=key, peers=peers, count=count,
                                              expiration=now() + FLOOD_LIFETIME))


def plain_attacker(initial_peers: list[str]) -> DHT:
    """The attacker: a stock hivemind peer, which keeps whatever it is sent (itself included)."""
    return stock_peer(initial_peers)


def env_without_peers() -> dict:
    """A command's environment with no default peers: it joins the peers it is given alone."""
    return {"SWARM_BOOTSTRAP_FILE": os.devnull, "SWARM_INITIAL_PEERS": ""}


# ----- without protection the flood blinds; halt says so ---------------------------------------------------
def stock_peer(initial_peers: Optional[list[str]] = None) -> DHT:
    """A stock hivemind peer (a third-party bootstrap peer): it keeps whatever it is sent, unbounded."""
    return DHT(initial_peers=initial_peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
               record_validators=[RSASignatureValidator()])


def test_a_flood_on_a_stock_peer_blinds_readers_and_halt_says_it_was_not_read_back(tmp_path, local_swarm):
    """The issue's attack where the only storing peer is a stock hivemind peer: readers see nothing, loudly, and
    ``publish`` (``python -m swarm.governance halt``) no longer says "stored" for a record nobody can read. (The
    session swarm only forks the status command, which joins this test's peers alone: an exec'd one imports
    hivemind first, 1-2 CPU s.)"""
    bootstrap = stock_peer()
    peers = visible_maddrs(bootstrap)
    operator = start_dht(NetworkConfig(initial_peers=peers, client_mode=True, use_default_peers=False))
    try:
        prefix, key = "blinded", generate_private_key(tmp_path / "gov.key")
        # The flood in the stock peer's storage (as an attacker's peer would push it, and the next test does): the
        # stock peer itself stores it, one DHT peer fewer; its reply for the key is past libp2p's message.
        assert flood(bootstrap, governance_key(prefix), []) == []
        assert bootstrap.run_coroutine(partial(_held_bytes, key=governance_key(prefix))) > 4 * 2**20
        # A reader in a process of its own, the status command, reads the flooded key while the halt is published
        # here (each reader waits out the lost reply, 3 s, and the command reads again): it reads nothing either way.
        status = local_swarm.start_command("status", [
            "-m", "swarm.governance", "status", "--governance-key", public_key_text(key), "--dht-prefix", prefix,
            "--initial-peers", peers[0]])
        try:
            assert publish(operator, key, prefix, HALT, "incident", read_back_seconds=UNREAD_SECONDS) is None, \
                "a halt nobody can read was 'stored'"
            assert GovernanceGuard(operator, prefix, [public_key_text(key)]).current(force=True) is None
            status.process.wait(timeout=120)
        finally:
            if status.alive:
                local_swarm.terminate(status, signal.SIGKILL)
        # The reader says which key and which peer it lost (the DHT process's warning, in the command's output).
        said = (f"gave no usable reply for {governance_key(prefix)}", "no valid governance record")
        assert wait_until(lambda: all(text in "\n".join(status.log) for text in said), timeout=10, interval=0.2), \
            "\n".join(status.log)
    finally:
        for dht in (operator, bootstrap):
            stop_dht(dht)


# ----- every swarm peer keeps every key readable -------------------------------------------------------------
async def _held_bytes(dht: DHT, node: DHTNode, key: str) -> int:
    found = node.protocol.storage.get(DHTID.generate(source=key))
    if found is None or not isinstance(found.value, DictionaryDHTValue):
        return 0
    return sum(entry_bytes(subkey, item.value) for subkey, item in found.value.items())


def test_a_swarm_peer_that_knows_no_prefix_keeps_a_flooded_key_readable(tmp_path):
    """``python -m swarm.dht`` without ``--dht-prefix`` cannot tell junk from records, but keeps every key within
    ``MAX_KEY_BYTES``: the flood stops there, its reply still reaches readers and names the server holding the halt.
    The reader joined before that server and learns of it from this reply only: a stock peer loses the reply (above)
    and the reader sees no halt; this was the CI failure of a fresh ``governance halt`` late in the full suite."""
    bootstrap = start_dht(NetworkConfig(use_default_peers=False))  # knows no prefix
    peers = visible_maddrs(bootstrap)
    reader = start_dht(NetworkConfig(initial_peers=peers, client_mode=True, use_default_peers=False))
    prefix, key = "bounded", generate_private_key(tmp_path / "gov.key")
    public = public_key_text(key)
    server = start_dht(NetworkConfig(initial_peers=peers, use_default_peers=False),
                       protect=protected_keys(prefix, 0, trusted_signers([public])))
    operator = start_dht(NetworkConfig(initial_peers=peers, client_mode=True, use_default_peers=False))
    try:
        # The flood comes from the operator's peer (one DHT peer fewer than an attacker's own): the storing peers
        # judge plain subkeys by the key's policy whoever sends them. Its own bounded copy is dropped: what this
        # test reads is the bootstrap peer's reply.
        assert flood(operator, governance_key(prefix), [str(bootstrap.peer_id), str(server.peer_id)]) \
            == [False, False], "a peer kept the whole flood"
        forget_local_copies(operator, [governance_key(prefix)])
        held = bootstrap.run_coroutine(partial(_held_bytes, key=governance_key(prefix)))
        assert MAX_KEY_BYTES - 2 * len(FLOOD_VALUE) < held <= MAX_KEY_BYTES, held
        assert publish(operator, key, prefix, HALT, "incident", read_back_seconds=30) is not None
        decision = GovernanceGuard(reader, prefix, [public]).current(force=True)
        assert decision is not None and decision.halted and decision.reason == "incident"
    finally:
        for dht in (operator, server, reader, bootstrap):
            stop_dht(dht)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=40), st.integers(0, 64 * 1024)), max_size=80),
       st.integers(0, 2 * MAX_KEY_BYTES))
def test_no_sequence_of_stores_takes_a_key_past_what_a_reply_carries(entries, regular_size):
    """Any writes, on a peer that knows no key (no policy): a key's dictionary stays within ``MAX_KEY_BYTES`` and
    ``MAX_KEY_SUBKEYS``, an update of a held subkey within the bound passes, and a regular value over it is refused."""
    storage = DHTLocalStorage()
    protect_storage([storage], {})
    key, expiration = DHTID.generate(source="any.key"), now() + 60
    for subkey, size in entries:
        storage.store_subkey(key, subkey, b"v" * size, expiration)
        held = storage.get(key).value if storage.get(key) is not None else {}
        assert len(held) <= MAX_KEY_SUBKEYS
        assert sum(entry_bytes(s, item.value) for s, item in held.items()) <= MAX_KEY_BYTES
    if entries and storage.get(key) is not None:
        subkey, _ = next(iter(storage.get(key).value.items()))
        assert storage.store_subkey(key, subkey, b"u", expiration + 1) is True, "a held subkey's update was refused"
    other = DHTID.generate(source="other.key")
    assert storage.store(other, b"r" * regular_size, expiration) is (regular_size <= MAX_KEY_BYTES)


def test_a_key_holds_a_bounded_number_of_tiny_subkeys():
    storage = DHTLocalStorage()
    protect_storage([storage], {})
    key, expiration = DHTID.generate(source="tiny.key"), now() + 60
    answers = [storage.store_subkey(key, i.to_bytes(4, "big"), b"", expiration) for i in range(MAX_KEY_SUBKEYS + 5)]
    assert answers == [True] * MAX_KEY_SUBKEYS + [False] * 5


# ----- with protection: honest peers refuse the flood, the halt stops a client ----------------------------------
def test_servers_refuse_the_flood_and_a_halt_still_stops_a_client(local_swarm, attacker,  # noqa: F811 (fixture)
                                                                  tiny_model_path, tmp_path, swarm_peer):
    prefix, peers = default_prefix(tiny_model_path), honest_peers(local_swarm)
    try:
        servers = [p.peer_id for p in local_swarm.processes[1:4]]  # the fixture's three servers of this model
        accepted = dict(zip(peers, flood(attacker, governance_key(prefix), peers)))
        # Servers know the model's keys and refuse every plain subkey; the bootstrap peer knows none and keeps them
        # up to MAX_KEY_BYTES (so its replies stay readable).
        assert not any(accepted[p] for p in servers), accepted
        key = generate_private_key(tmp_path / "gov.key")
        public = public_key_text(key)
        network = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
        operator = ["--key", str(tmp_path / "gov.key"), "--dht-prefix", prefix, *network]
        halted = CliRunner().invoke(governance_cli, ["halt", *operator, "--reason", "flooded but heard"],
                                    catch_exceptions=False)
        assert halted.exit_code == 0 and "read back" in halted.output, halted.output
        with DistributedDiffusionLM.from_pretrained(tiny_model_path, dht=swarm_peer,
                                                    governance_keys=(public,)) as governed:
            result = governed.generate("stop me", **SETTINGS)
        assert result.finish_reason == "halted" and result.info["halt"]["reason"] == "flooded but heard"
        # The halt and the client read through the attacker's own copy of the flood (a reply lost, waited out for
        # hivemind's 3 s); the resume need not wait it out a third time.
        forget_local_copies(attacker, [governance_key(prefix)])
        # Only this test's client trusts the key: the resume is not cleanup, it checks that the operator can resume
        # (what ``governance resume`` calls, from the file's DHT peer: the command's own is one more, ~1 CPU s).
        resumed = publish(swarm_peer, key, prefix, RESUME, "over")
        assert resumed is not None and resumed.action == RESUME
    finally:  # (if the test failed before): the attacker's copy would make each later read of the key wait 3 s
        forget_local_copies(attacker, [governance_key(prefix)])


def test_protected_keys_refuse_plain_subkeys_regular_values_and_records_of_other_peers(tmp_path):
    """On a peer that knows the model: a plain subkey, a regular value replacing the dictionary, and records of
    other peer ids (a sybil fill: one peer signing records for free made-up ids until the block key's bound keeps
    real servers out) are refused; a peer's own record is kept; other keys (hivemind's own) keep plain subkeys.
    The forgeries come from the honest peer's own DHT process (one DHT peer fewer than an attacker's own): the storer
    judges a subkey by the key's policy and a record by its owner against the sender, whoever sends them."""
    storer = start_dht(NetworkConfig(use_default_peers=False), protect=protected_keys("capped", 2))
    peers = visible_maddrs(storer)
    identity = Identity.load_or_create(None)
    honest = start_dht(NetworkConfig(initial_peers=peers, use_default_peers=False), identity=identity)
    attacker_dht = honest
    target = [str(storer.peer_id)]
    try:
        key, expiration = block_key("capped", 1), now() + 60
        assert forge(attacker_dht, key, b"plain", {"a": 1}, expiration, target) == [False]
        assert forge(attacker_dht, key, b"plain", {"a": 1}, expiration, target, in_cache=True) == [False], \
            "the cache, which readers also answer from, took a plain subkey"
        assert forge(attacker_dht, "someone.elses.key", b"plain", {"a": 1}, expiration, target) == [True]
        sybils = rsa_owners(3)
        answers = [attacker_dht.run_coroutine(partial(_push_owned, owner=owner, key=key, subkey=owned_subkey(owner),
                                                      value=describe(key, {"n": i}), expiration=expiration,
                                                      peer=target[0]))
                   for i, owner in enumerate(sybils)]
        assert answers == [False] * len(sybils), "records of peer ids other than the sender's were stored"
        own = honest.run_coroutine(partial(_push_owned, owner=identity.validator, key=key,
                                           subkey=identity.owner_subkey(), value=describe(key, {"n": 0}),
                                           expiration=expiration, peer=target[0]))
        assert own is True, "a peer's own record was refused"
        regular = attacker_dht.run_coroutine(partial(_push_regular, key=key, expiration=expiration + 600,
                                                     peer=target[0]))
        assert regular is False, "a regular value would replace every record under the key"
    finally:
        for dht in (honest, storer):
            stop_dht(dht)
        identity.remove()


@pytest.mark.parametrize("owned_key", [block_key("capped", 1), expert_index_key("capped")])
def test_owned_keys_keep_a_bounded_number_of_owners_of_bounded_size(owned_key):
    """The storage bounds behind the live test, on both kinds of owned key: a record sent by a peer other than its
    owner, an oversized value, an expiration past the bound and a subkey beyond the bound are refused; an update of
    a held subkey passes."""
    key = owned_key
    policy = next(policy for policy in protected_keys("capped", 2) if policy.name == key)
    storage = DHTLocalStorage()
    protect_storage([storage], {dht_key_id(policy.name): policy})
    owners = rsa_owners(MAX_OWNED_SUBKEYS + 1)

    def store(owner: RSASignatureValidator, value: bytes, expiration: float, sender: str = "") -> bool:
        subkey = owned_subkey(owner)
        token = STORE_SENDER.set(sender or subkey.split(b"[owner:")[0].decode())
        try:
            return storage.store_subkey(DHTID.generate(source=key), subkey, value, expiration)
        finally:
            STORE_SENDER.reset(token)

    expiration, v, w = now() + 60, described_value(key, 100), described_value(key, 101)
    relayed = owned_subkey(owners[1]).split(b"[owner:")[0].decode()
    assert store(owners[0], v, expiration, sender=relayed) is False, "another peer's record was stored"
    assert store(owners[0], described_value(key, MAX_OWNED_VALUE_BYTES + 1), expiration) is False, \
        "an oversized value was stored"
    assert store(owners[0], b"v", expiration) is False, "a value that does not name its key was stored"
    assert store(owners[0], v, now() + MAX_OWNED_LIFETIME + 60) is False, "a squatter's month-long record was stored"
    assert store(owners[0], described_value(key, MAX_OWNED_VALUE_BYTES), expiration) is True
    assert [store(owner, v, expiration) for owner in owners[1:]] == [True] * (MAX_OWNED_SUBKEYS - 1) + [False]
    assert store(owners[0], w, expiration + 1) is True, "an update of a held subkey must pass"
    honest = ServerConfig(update_period=MAX_UPDATE_PERIOD).record_expiration
    assert store(owners[1], v, now() + honest) is True, "a record of the longest allowed update period was refused"


@pytest.mark.parametrize("slot_key, max_bytes, max_slots", [
    (adapter_index_key("capped"), MAX_ADAPTER_INDEX_BYTES, MAX_ADAPTER_AUTHORS),
    (governance_key("capped"), MAX_DECISION_VALUE_BYTES, MAX_UNTRUSTED_SLOTS),  # a peer that trusts no key
])
def test_signed_slot_keys_keep_a_bounded_number_of_slots_of_bounded_size(slot_key, max_bytes, max_slots):
    """The adapter index and an untrusting peer's governance key (issue 33: every key the project reads) take only
    Ed25519 slot subkeys, each value bounded, one more author than the bound refused: a flood of plain subkeys or
    of fresh keys' slots cannot push the reply past what a reader receives."""
    policy = next(policy for policy in protected_keys("capped", 2) if policy.name == slot_key)
    storage = DHTLocalStorage()
    protect_storage([storage], {dht_key_id(slot_key): policy})
    authors = [Ed25519PrivateKey.generate() for _ in range(max_slots + 1)]
    expiration = now() + 60

    def store(subkey, value: bytes, when: float = expiration) -> bool:
        return storage.store_subkey(DHTID.generate(source=slot_key), subkey, value, when)

    def with_work(value: bytes, author) -> bytes:
        """The value with the work stamp a shared list asks of each slot (issue 55, ``swarm.dht.stamp``)."""
        if not policy.stamp_bits:
            return value
        stamp = make_stamp(dht_key_id(slot_key), ed25519_text(author), policy.stamp_bits)
        return MSGPackSerializer.dumps({**MSGPackSerializer.loads(value), STAMP_FIELD: stamp})

    v = described_value(slot_key, 100)
    assert store(b"plain", v) is False, "a plain subkey was stored"
    assert store(slot_subkey(authors[0]), b"v") is False, "a value that does not name its key was stored"
    assert store(slot_subkey(authors[0]), with_work(described_value(slot_key, max_bytes + 1), authors[0])) is False, \
        "an oversized value was stored"
    assert [store(slot_subkey(author), with_work(v, author)) for author in authors] == [True] * max_slots + [False]
    assert store(slot_subkey(authors[0]), with_work(described_value(slot_key, 101), authors[0]),
                 expiration + 1) is True, "an update of a held slot must pass"


class _SybilKey(RSAPrivateKey):
    """A 1,024-bit RSA key: a made-up peer id as good as a 2,048-bit one (the bounds count owners, and an owner subkey
    of either size fits), made in a fifth of the time (33 keys of 2,048 bits cost a test about 1.2 CPU s)."""

    def __init__(self):
        self._private_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)


_RSA_KEYS: list[RSAPrivateKey] = []


def rsa_owners(count: int) -> list[RSASignatureValidator]:
    """Validators of ``count`` distinct RSA keys (peer ids), the first of the keys made so far in this process: each
    test stores under storage of its own, so sharing them changes nothing."""
    while len(_RSA_KEYS) < count:
        _RSA_KEYS.append(_SybilKey())
    return [RSASignatureValidator(key) for key in _RSA_KEYS[:count]]


def described_value(key: str, size: int) -> bytes:
    """A stored value of exactly ``size`` bytes that names ``key`` (as every value the swarm stores does)."""
    base = len(MSGPackSerializer.dumps(describe(key, {"pad": b"", "q": b""})))
    for pad in range(max(0, size - base), -1, -1):  # msgpack's length headers grow by steps: a second pad fills in
        for extra in range(8):
            value = MSGPackSerializer.dumps(describe(key, {"pad": b"x" * pad, "q": b"x" * extra}))
            if len(value) == size:
                return value
    raise ValueError(f"no value of {size} bytes names {key!r}")


def owned_subkey(validator: RSASignatureValidator) -> bytes:
    """``{peer id}[owner:KEY]`` for the peer id of ``validator``'s own key (as a server's identity makes it)."""
    from swarm.dht.identity import peer_id_from_owner_key

    owner = validator.local_public_key
    return peer_id_from_owner_key(owner[len(b"[owner:"):-1]).encode() + owner


async def _push_owned(dht: DHT, node: DHTNode, owner: RSASignatureValidator, key: str, subkey: bytes, value,
                      expiration: float, peer: str) -> bool:
    from hivemind.dht.validation import DHTRecord

    record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                       MSGPackSerializer.dumps(value), expiration)
    signed = owner.sign_value(record)
    answer = await node.protocol.call_store(PeerID.from_base58(peer), [DHTID.generate(source=key)], [signed],
                                            expiration, subkeys=[subkey])
    return bool(answer and answer[0])


async def _push_regular(dht: DHT, node: DHTNode, key: str, expiration: float, peer: str) -> bool:
    answer = await node.protocol.call_store(PeerID.from_base58(peer), [DHTID.generate(source=key)],
                                            [MSGPackSerializer.dumps("junk")], expiration)
    return bool(answer and answer[0])


# ----- records signed by the attacker's own id: nobody raises, the health map stays valid JSON ------------------
def hostile_values() -> dict[int, dict]:
    """Records by block (one per key: a peer holds one subkey per key); each raised OverflowError or worse before.
    Built inside the DHT process: hivemind's pipe to it refuses messages of a megabyte."""
    base = {"record_version": RECORD_VERSION, "state": 2, "start": 0, "end": 2, "throughput": 1.0}
    return {0: dict(base, start=float("inf")), 1: dict(base, state=float("inf")),
            2: dict(base, cache_tokens_left=float("inf")),
            3: dict(base, version="v" * 1_000_000, extra={"x": {"nested": [1, 2]}}, public_name=b"bytes")}


def hostile_index() -> dict:
    """An expert index entry of 2,000 domains, one with a NaN throughput and one with bytes for its model."""
    tag = {"tokenizer": "byte-v1", "vocab_size": 260, "mask_token_id": 259}
    experts = [{"record_version": RECORD_VERSION, "domain": f"d{i}", "state": 2, "tag": tag, "throughput": 1.0}
               for i in range(2000)]
    experts[0] = dict(experts[0], throughput=float("nan"))
    experts[1] = dict(experts[1], model=b"\xff\xfe bytes")
    return {"record_version": RECORD_VERSION, "experts": experts}


async def _store_hostile(dht: DHT, node: DHTNode, prefix: str, subkey: bytes, expiration: float) -> None:
    records = hostile_values()
    keys = [block_key(prefix, block) for block in records] + [expert_index_key(prefix)]
    await node.store_many(keys, subkeys=[subkey] * len(keys), values=[*records.values(), hostile_index()],
                          expiration_time=expiration)


@pytest.fixture(scope="module")
def hostile_records(local_swarm, tiny_model_path):
    """A peer with its own identity (anyone can make one) signs hostile records under the model's keys. Peers
    that know the model keep those within the size bound (the infinities); the hostile peer keeps them all."""
    prefix = default_prefix(tiny_model_path)
    identity = Identity.load_or_create(None)
    dht = start_dht(NetworkConfig(initial_peers=local_swarm.initial_peers), identity=identity)
    dht.run_coroutine(partial(_store_hostile, prefix=prefix, subkey=identity.owner_subkey(), expiration=now() + 300))
    yield prefix, dht
    stop_dht(dht)
    identity.remove()


def test_no_hostile_record_stops_a_client_or_breaks_the_health_json(local_swarm, hostile_records, tiny_model_path,
                                                                     local_lm):
    prefix, hostile = hostile_records
    for reader in (hostile,):  # the hostile peer's own storage holds every record: the readers meet them all
        servers = read_servers(reader, prefix, 4)
        assert all(record.start < record.end <= 4 for record in servers.values())
        experts = read_all_experts(reader, prefix)
        assert len(hostile_domains(experts)) <= MAX_EXPERTS_PER_SERVER and "d0" not in experts  # NaN: refused
    with DistributedDiffusionLM.from_pretrained(tiny_model_path, initial_peers=local_swarm.initial_peers,
                                                route_refresh=0.0, request_timeout=20) as lm:
        assert lm.generate("still here", **SETTINGS).token_ids == local_lm.generate("still here", **SETTINGS).token_ids
    # The health map reads the same records (stored by the fixture) through its own DHT peer: the command in this
    # process (a second interpreter would import torch and hivemind first, 2-3 CPU s).
    mapping = CliRunner().invoke(health_main, [
        "--json", "--dht-prefix", prefix, "--num-blocks", "4",
        *[arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]], env=env_without_peers())
    assert mapping.exit_code in (0, 1), (mapping.output[-2000:], mapping.exception)
    stdout = mapping.stdout

    def no_constants(name: str):
        raise AssertionError(f"invalid JSON constant {name}")

    health = json.loads(stdout, parse_constant=no_constants)
    assert health["fully_served"] and len(hostile_domains(health["experts"])) <= MAX_EXPERTS_PER_SERVER


def hostile_domains(experts: dict) -> set[str]:
    """The domains of :func:`hostile_index` among those read: earlier tests' honest experts (on the session swarm,
    under the same model) may be read beside them, depending on which tests ran before."""
    return {domain for domain in experts if re.fullmatch(r"d\d+", domain)}


def test_signed_slots_of_strangers_are_refused_under_a_trusted_governance_key(tmp_path):
    """A peer that trusts governance keys keeps only their slots under the shared key: free Ed25519 keys cannot fill it.
    A stranger's decision lives only under its own key (issue 55), which no reader trusting others reads."""
    trusted = generate_private_key(tmp_path / "gov.key")
    storer = start_dht(NetworkConfig(use_default_peers=False),
                       protect=protected_keys("governed", governance_signers=[public_key_text(trusted)]))
    peers = visible_maddrs(storer)
    operator = start_dht(NetworkConfig(initial_peers=peers, client_mode=True, use_default_peers=False))
    try:
        stranger = Ed25519PrivateKey.generate()
        publish(operator, stranger, "governed", HALT, "free keys", read_back_seconds=UNREAD_SECONDS)
        shared = storer.get(governance_key("governed"), latest=True)
        assert shared is None or slot_subkey(stranger) not in shared.value, "a stranger's slot under the shared key"
        decision = publish(operator, trusted, "governed", RESUME, "set-up")
        assert decision is not None and decision.action == RESUME
        state = GovernanceState("governed", [trusted.public_key()])
        assert state.refresh(operator) == decision and not state.halted
    finally:
        stop_dht(operator)
        stop_dht(storer)


# ----- governance fails safe ------------------------------------------------------------------------------------
def test_a_client_that_reads_no_decision_for_longer_than_the_bound_stops(local_swarm, tiny_model_path, tmp_path,
                                                                          swarm_peer):
    """Keys trusted, no decision readable (blinded, or never published): generation stops with 'halted' and a
    reason that says so, then goes on once a decision is read."""
    key = generate_private_key(tmp_path / "gov.key")
    with DistributedDiffusionLM.from_pretrained(tiny_model_path, dht=swarm_peer,
                                                governance_keys=(public_key_text(key),),
                                                governance_stale_after=1.0) as lm:
        assert wait_until(lambda: lm.guard.unreadable() is not None, timeout=30)
        stopped = lm.generate("blind", **SETTINGS)
        assert stopped.finish_reason == "halted" and stopped.steps == 0
        assert "governance state unreadable" in stopped.info["halt"]["reason"]
        assert publish(lm.dht, key, default_prefix(tiny_model_path), RESUME, "set-up") is not None
        assert lm.generate("heard", **SETTINGS).finish_reason != "halted"


def test_a_server_that_reads_no_decision_for_longer_than_the_bound_refuses(local_swarm, tmp_path, swarm_peer):
    """The same for a server (--governance-stale-after): it answers with the reason, then serves after a resume."""
    from tests.conftest import make_checkpoint, tiny_config
    from tests.test_governance import RPC_POLL, refused

    key = generate_private_key(tmp_path / "gov.key")
    path = make_checkpoint(tmp_path / "stale-model", tiny_config(), seed=9)
    server = local_swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--governance-key",
                                      public_key_text(key), "--governance-stale-after", "2")
    try:
        with DistributedDiffusionLM.from_pretrained(path, dht=swarm_peer) as lm:
            assert wait_until(lambda: refused(lm, server), timeout=60, interval=RPC_POLL), \
                "the server served on, unaware"
            # the server's log reaches server.log through a reader thread, maybe after its refusal reached us
            assert wait_until(lambda: any("governance state unreadable" in line for line in server.log), timeout=10)
            assert publish(lm.dht, key, default_prefix(path), RESUME, "set-up") is not None
            assert wait_until(lambda: not refused(lm, server), timeout=60, interval=RPC_POLL), \
                "the resume was not read"
    finally:
        stop_all(local_swarm, [server])  # its own prefix
