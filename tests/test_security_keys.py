"""Issue 48, 2: a key whose name is computed by its readers (a published name, a content hash, an auditor's key)
hidden before it is written, against real DHT peers that know no prefix and no name.

The attacker computes the key offline and stores 1,024 one-byte plain subkeys under it (0.3 s, 30-day expiry), or a
regular value that outlives every record, or validly signed slots of fresh keys until the key's bound is reached.
Storing peers learn the key's policy from the first value that names it (``swarm.dht.keys``): the flood is dropped
and the honest record stored, so a reader on another peer finds it. Without that, every peer refuses the honest
record (the key is full, or a regular value blocks subkeys) and the name is hidden.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht import DHT, DHTNode
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer

from swarm.adapters.sharing import PublishedAdapter, author_id, declare_hosted, signed_value
from swarm.adapters.sharing import hosts_key as adapter_hosts_key
from swarm.adapters.sharing import name_key as adapter_name_key
from swarm.adapters.sharing import publish as publish_adapter
from swarm.adapters.sharing import read_hosts as read_adapter_hosts
from swarm.adapters.sharing import read_published as read_adapter
from swarm.dht.identity import Identity
from swarm.dht.keys import GOVERNANCE, WEIGHTS_NAME
from swarm.dht.node import NetworkConfig, start_dht, stop_dht, visible_maddrs
from swarm.dht.schema import audit_key, forget_local_copies, governance_key, now, protected_keys
from swarm.dht.validation import ed25519_text, slot_subkey
from swarm.reports.records import AuditReport, publish_report, read_report
from swarm.weights.records import (
    READ_BACK_SECONDS,
    HostRecord,
    PublishedModel,
    WeightsError,
    declare_host,
    hosts_key,
    name_key,
    own_name_key,
)
from swarm.weights.records import publish as publish_name
from swarm.weights.records import read_hosts as read_weight_hosts
from swarm.weights.records import read_published as read_names
from tests.test_security_dht import plain_attacker

PREFIX = "hidden"
SHA = "ab" * 32
MONTH = 30 * 24 * 3600.0
# Storing peers of a network: two show "every storing peer" as three did (each is a DHT process and a libp2p daemon,
# and every flood below is sent to each of them)
STORERS = 2


# ----- the attacker (runs in its stock hivemind DHT process) ------------------------------------------------
async def _hide(dht: DHT, node: DHTNode, key: str, peers: list[str], count: int, regular: bool) -> list[bool]:
    """Per peer, whether it took ``count`` one-byte plain subkeys under ``key`` for a month (or one regular value for
    a year: past any record's expiration, hivemind refuses every subkey under it), in requests of 256."""
    key_id, value = DHTID.generate(source=key), MSGPackSerializer.dumps(b"x")
    expiration = now() + (12 if regular else 1) * MONTH
    if regular:  # the attacker's own storage, which readers ask too, holds the same
        node.protocol.storage.store(key_id, value, expiration)
    for i in range(0 if regular else count):
        node.protocol.storage.store_subkey(key_id, i.to_bytes(2, "big"), value, expiration)
    accepted = []
    for peer in peers:
        if regular:
            answer = await node.protocol.call_store(PeerID.from_base58(peer), [key_id], [value], expiration)
            accepted.append(bool(answer and answer[0]))
            continue
        answers = []
        for start in range(0, count, 256):
            subkeys = [i.to_bytes(2, "big") for i in range(start, min(count, start + 256))]
            answer = await node.protocol.call_store(PeerID.from_base58(peer), [key_id] * len(subkeys),
                                                    [value] * len(subkeys), expiration, subkeys=subkeys)
            answers += answer or [False]
        accepted.append(all(answers))
    return accepted


def hide(attacker: DHT, key: str, peers: list[str], count: int = 1024, regular: bool = False) -> list[bool]:
    return attacker.run_coroutine(partial(_hide, key=key, peers=peers, count=count, regular=regular))


async def _squat(dht: DHT, node: DHTNode, key: str, name: str, peers: list[str], count: int,
                 expiration: float) -> list[int]:
    """Per peer, how many of ``count`` slots signed by fresh keys (each value naming ``name``) it took under ``key``.

    The slots are made here, in the attacker's DHT process: sent through hivemind's pipe to that process, 64 of them
    (over 16 KB) go in two writes, and a process that wakes between them reads half a message (its loop made the
    pipe non-blocking), logs ``BlockingIOError``, then dies unpickling the rest (seen once, in a loaded run)."""
    slots = []
    for _ in range(count):
        fresh = Ed25519PrivateKey.generate()
        payload = PublishedModel(name, "cd" * 32, 1000, 2000, time.time()).payload()
        slots.append((slot_subkey(fresh), signed_value(fresh, key, payload, expiration)))  # stamped where asked
    key_id, taken = DHTID.generate(source=key), []
    for peer in peers:
        for _ in range(3):  # a store that never answers (seen once in four loaded runs) is asked again
            try:
                answer = await asyncio.wait_for(node.protocol.call_store(
                    PeerID.from_base58(peer), [key_id] * len(slots), [MSGPackSerializer.dumps(v) for _, v in slots],
                    expiration, subkeys=[s for s, _ in slots]), timeout=30)
            except asyncio.TimeoutError:
                answer = None
            if answer is not None:
                break
        taken.append(sum(answer or []))
    return taken


# ----- the network: storing peers that know no prefix and no name ---------------------------------------------
@dataclass
class Network:
    storers: list[DHT]
    writer: DHT  # a peer with a libp2p identity (it signs hosts records); tests drop its own copies before reading
    writer_identity: Identity
    reader: DHT  # another peer: what it reads is what the swarm returns, not the writer's copy

    @property
    def storing_peers(self) -> list[str]:
        return [str(dht.peer_id) for dht in self.storers]


def start_network(trusted: tuple[str, ...] = ()) -> Network:
    """``STORERS`` storing swarm peers (``trusted``: governance keys they trust, from a prefix they know), a writer and
    a reader."""
    protect = protected_keys("another-model", 0, trusted) if trusted else []
    first = start_dht(NetworkConfig(use_default_peers=False), protect=protect)
    peers = visible_maddrs(first)
    storers = [first] + [start_dht(NetworkConfig(initial_peers=peers, use_default_peers=False), protect=protect)
                         for _ in range(STORERS - 1)]
    identity = Identity.load_or_create(None)
    writer = start_dht(NetworkConfig(initial_peers=peers, use_default_peers=False), identity=identity)
    reader = start_dht(NetworkConfig(initial_peers=peers, client_mode=True, use_default_peers=False))
    return Network(storers, writer, identity, reader)


@contextmanager
def attacker(network: Network) -> Iterator[DHT]:
    """A stock hivemind peer that joins, writes and leaves: while it runs, its own storage keeps whatever it is sent
    (the honest record too) and answers readers, so what readers find after it left is what the swarm's peers kept."""
    dht = plain_attacker(visible_maddrs(network.storers[0]))
    try:
        yield dht
    finally:
        stop_dht(dht)


@pytest.fixture(scope="module")
def prober(network) -> Iterator[DHT]:
    """A stock hivemind peer in client mode, for floods whose point is only what the storing peers take or answer
    (before or after they learnt the key): the storing peers judge a plain subkey, a regular value or a slot by the
    key's policy whoever sends it, and a client-mode peer stores nothing for others and is asked by no reader, so
    what readers find is what the storing peers kept, as after :func:`attacker` left; it may stay for the module
    (one libp2p daemon instead of one per flood)."""
    dht = DHT(initial_peers=visible_maddrs(network.storers[0]), start=True, client_mode=True,
              host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=[RSASignatureValidator()])
    unlearnt = f"probed-{time.monotonic_ns() % 10**9}"  # a key no value has named: every storing peer takes a flood
    assert hide(dht, unlearnt, network.storing_peers, count=8) == [True] * STORERS, \
        "the storing peers refuse this peer's stores whatever the key: its refusals below would prove nothing"
    yield dht
    stop_dht(dht)


def stop_network(network: Network) -> None:
    for dht in (network.reader, network.writer, *network.storers):
        stop_dht(dht)
    network.writer_identity.remove()


@pytest.fixture(scope="module")
def network():
    network = start_network()
    yield network
    stop_network(network)


# ----- the families: how the honest peer writes, and what another peer reads -----------------------------------
@dataclass(frozen=True)
class Family:
    key: Callable[[str], str]  # the key of a fresh name
    write: Callable[[Network, str], None]
    found: Callable[[Network, str], bool]  # whether the reader finds the honest record


# A publish expected to fail gives up after this (the default, 20 s, is for a peer that has just joined; here every
# peer is up and the refusal is final, so the later read-backs would only repeat the first)
REFUSED_READ_BACK_SECONDS = 3.0


def publish_weights_name(network: Network, name: str, key: Ed25519PrivateKey = None,
                         read_back_seconds: float = READ_BACK_SECONDS) -> None:
    record = PublishedModel(name, SHA, 1000, 2000, time.time())
    publish_name(network.writer, key or Ed25519PrivateKey.generate(), record,  # raises unless read back
                 read_back_seconds=read_back_seconds)


def weights_name_found(network: Network, name: str) -> bool:
    return any(r.model_id == SHA for r in read_names(network.reader, name))


def publish_adapter_name(network: Network, name: str) -> None:
    record = PublishedAdapter(name, SHA, 100, {"model": "tiny"}, published=time.time())
    publish_adapter(network.writer, Ed25519PrivateKey.generate(), PREFIX, record)


def adapter_name_found(network: Network, name: str) -> bool:
    return any(r.sha256 == SHA for r in read_adapter(network.reader, PREFIX, name))


def sha_of(name: str) -> str:
    import hashlib

    return hashlib.sha256(name.encode()).hexdigest()


def declare_adapter_host(network: Network, name: str) -> None:
    # (what a store returns is the last peer's answer, the attacker's refusal perhaps: the reader says what counts)
    declare_hosted(network.writer, PREFIX, {sha_of(name): 100}, network.writer_identity.owner_subkey(), now() + 600,
                   ["/ip4/127.0.0.1/tcp/1"])


def adapter_host_found(network: Network, name: str) -> bool:
    return str(network.writer.peer_id) in read_adapter_hosts(network.reader, PREFIX, sha_of(name))


def declare_weights_host(network: Network, name: str) -> None:
    record = HostRecord(str(network.writer.peer_id), ("/ip4/127.0.0.1/tcp/1",), 1000)
    declare_host(network.writer, sha_of(name), record, network.writer_identity.owner_subkey(), now() + 600)


def weights_host_found(network: Network, name: str) -> bool:
    return any(h.peer_id == str(network.writer.peer_id) for h in read_weight_hosts(network.reader, sha_of(name)))


AUDITOR = Ed25519PrivateKey.generate()


def publish_audit(network: Network, name: str) -> None:
    report = AuditReport(prefix=name, auditor=ed25519_text(AUDITOR), sequence=1, published=time.time())
    assert publish_report(network.writer, AUDITOR, report, 600) is not None


def audit_found(network: Network, name: str) -> bool:
    report = read_report(network.reader, name, ed25519_text(AUDITOR))
    return report is not None and report.sequence == 1


FAMILIES = {
    "model name": Family(name_key, publish_weights_name, weights_name_found),
    "adapter name": Family(lambda n: adapter_name_key(PREFIX, n), publish_adapter_name, adapter_name_found),
    "adapter hosts": Family(lambda n: adapter_hosts_key(PREFIX, sha_of(n)), declare_adapter_host, adapter_host_found),
    # not named by the issue: the hosts of a model id, and an auditor's report (its key names the auditor)
    "model hosts": Family(lambda n: hosts_key(sha_of(n)), declare_weights_host, weights_host_found),
    "audit report": Family(lambda n: audit_key(n, ed25519_text(AUDITOR)), publish_audit, audit_found),
}


SHOWN = ("model name", False, "shown")  # the show command's name: flooded as the model name family's plain subkeys


@pytest.fixture(scope="module")
def flooded(network, prober) -> dict[tuple[str, bool, str], tuple[str, list[bool]]]:
    """Issue 48's floods, sent before any honest write, of a fresh name of each family (1,024 plain subkeys, or a
    regular value) and the show test's: (family, regular, use) -> (the name, whether each storing peer took its
    flood). Sent by the prober, whom no reader asks (as if the flooder had left): the storing peers judge a flood by
    its key's policy, and learn none from a flood (it names no key)."""
    run = time.monotonic_ns() % 10**9
    cases = [(family, regular, "write") for family in FAMILIES for regular in (False, True)] + [SHOWN]
    names = {case: f"{case[2]}-{case[0].replace(' ', '-')}-{int(case[1])}-{run}" for case in cases}
    return {case: (name, hide(prober, FAMILIES[case[0]].key(name), network.storing_peers, regular=case[1]))
            for case, name in names.items()}


@pytest.mark.parametrize("regular", [False, True], ids=["1024 plain subkeys", "a regular value"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_key_flooded_before_it_is_written_still_takes_the_honest_record(network, flooded, prober, family, regular):
    """The issue's attack on each family: every storing peer takes the flood (the key is nobody's yet), then the
    honest write succeeds and another peer reads it."""
    chosen = FAMILIES[family]
    name, taken = flooded[family, regular, "write"]  # a name nobody had written, flooded by a peer gone since
    assert taken == [True] * STORERS, "the flood was refused before any record named the key: no attack to defend"
    chosen.write(network, name)
    forget_local_copies(network.writer, [chosen.key(name)])  # readers must get it from the storing peers
    assert chosen.found(network, name), f"the {family} record is hidden by the flood"
    # Once a peer has learnt the key, the flood is refused there.
    assert hide(prober, chosen.key(name), network.storing_peers, count=8) == [False] * STORERS


def test_a_name_publish_that_no_other_peer_reads_back_fails(network, prober):
    """A publish reports success only after a read that excludes its own copy: with every storing peer refusing
    the record (a regular value they took first, on peers whose policy was not learnt), ``publish`` raises. The
    module's storing peers lose their key registry for this test (and get it back after it)."""
    name = f"unlearnt-{time.monotonic_ns() % 10**9}"
    try:
        for dht in network.storers:  # peers that cannot learn: they keep the regular value, so refuse every subkey
            dht.run_coroutine(partial(_unprotect))
        publisher = Ed25519PrivateKey.generate()
        own = own_name_key(name, author_id(ed25519_text(publisher)))
        for key in (name_key(name), own):  # the prober, whom no reader asks: what counts is what the peers took
            assert hide(prober, key, network.storing_peers, regular=True) == [True] * STORERS
        with pytest.raises(WeightsError, match="it is not readable, so it is not published"):
            publish_weights_name(network, name, publisher, read_back_seconds=REFUSED_READ_BACK_SECONDS)
        forget_local_copies(network.reader, [name_key(name), own])
        assert not weights_name_found(network, name)
    finally:
        for dht in network.storers:
            dht.run_coroutine(partial(_reprotect))


async def _unprotect(dht: DHT, node: DHTNode) -> None:
    """A storing peer without the key registry (a stock hivemind peer's rules, plus the bounds of every key)."""
    for storage in (node.protocol.storage, node.protocol.cache):
        storage.unprotected_resolve, storage.resolve = storage.resolve, None


async def _reprotect(dht: DHT, node: DHTNode) -> None:
    """The key registry :func:`_unprotect` took away, back."""
    for storage in (node.protocol.storage, node.protocol.cache):
        storage.resolve = getattr(storage, "unprotected_resolve", storage.resolve)


def test_fresh_keys_filling_a_name_do_not_keep_its_publishers_out(tmp_path):
    """Issue 55's attack: 64 slots of fresh keys (each value naming the key) fill a model name's shared key before it
    is published (peers that trust no key keep the first slots that came). Every publisher's record lives under its own
    key too, which no other key can write: an untrusted publisher's publish succeeds, and a reader naming it or trusting
    it finds the record. Peers that trust a publisher's key still make room for it in the shared list."""
    trusted = Ed25519PrivateKey.generate()
    network = start_network(trusted=(ed25519_text(trusted),))
    try:
        name, expiration = f"squatted-{time.monotonic_ns() % 10**9}", now() + 3600
        key = name_key(name)
        # The slots are sent from the reader's DHT process, whose storage they do not touch (one DHT peer fewer than a
        # squatter's own): the storing peers judge a slot by the key's policy whoever sends it.
        squatter = network.reader
        taken = squatter.run_coroutine(partial(_squat, key=key, name=name, peers=network.storing_peers,
                                               count=WEIGHTS_NAME.max_subkeys, expiration=expiration))
        own = own_name_key(name, author_id(ed25519_text(trusted)))
        assert squatter.run_coroutine(partial(_squat, key=own, name=name, peers=network.storing_peers, count=4,
                                              expiration=expiration)) == [0] * STORERS, "a stranger took an own key"
        assert taken == [WEIGHTS_NAME.max_subkeys] * STORERS, taken
        stranger_publisher = Ed25519PrivateKey.generate()
        publish_weights_name(network, name, stranger_publisher, read_back_seconds=REFUSED_READ_BACK_SECONDS)
        publisher_id = author_id(ed25519_text(stranger_publisher))
        assert any(r.model_id == SHA for r in read_names(network.reader, name, [publisher_id]))
        assert not any(r.publisher_id == publisher_id for r in read_names(network.reader, name)), \
            "the shared list was not full: no attack to defend"
        publish_weights_name(network, name, trusted)
        found = read_names(network.reader, name)
        assert any(r.publisher == ed25519_text(trusted) and r.model_id == SHA for r in found)
        assert len(found) == WEIGHTS_NAME.max_subkeys, "the newest squatter's slot made room"
    finally:
        stop_network(network)


def test_show_from_another_peer_lists_a_name_flooded_before_it_was_published(network, flooded):
    """The issue's symptom, through the command: after the flood and the honest publish, ``python -m swarm.weights
    show NAME`` (its own DHT peer) lists the record instead of "no model is published under NAME"."""
    import json

    from click.testing import CliRunner

    from swarm.weights.__main__ import main as weights_main

    name, taken = flooded[SHOWN]
    assert taken == [True] * STORERS
    publish_weights_name(network, name)
    peers = [arg for maddr in visible_maddrs(network.storers[0]) for arg in ("--initial-peers", maddr)]
    shown = CliRunner().invoke(weights_main, ["show", name, *peers])
    assert shown.exit_code == 0, shown.output
    assert [record["model_id"] for record in json.loads(shown.stdout)] == [SHA]


def test_a_peer_answering_a_regular_value_hides_no_record_from_readers(network):
    """One hostile peer near the key keeps a regular value expiring in a year and answers it to every reader:
    hivemind's search keeps the answer that expires last, so it used to replace the other peers' records. Readers
    ignore a regular value under a key whose policy they know (every key they read)."""
    name = f"answered-{time.monotonic_ns() % 10**9}"
    with attacker(network) as liar:
        assert hide(liar, name_key(name), network.storing_peers, regular=True) == [True] * STORERS
        publish_weights_name(network, name)  # the liar refuses it (its regular value expires later)
        assert weights_name_found(network, name), "the liar's regular value replaced the record"


# ----- issue 55, 1: a peer made to learn many keys forgets none of them ---------------------------------------------
async def _learn_many(dht: DHT, node: DHTNode, peers: list[str], count: int, expiration: float) -> list[int]:
    """Per peer, how many of ``count`` distinct model-name keys it took a signed slot under (each value naming its
    own key, so the peer learns every one of them), sent in requests of 256 keys."""
    signer = Ed25519PrivateKey.generate()
    names = [f"learnt-{i}-{time.monotonic_ns() % 10**9}" for i in range(count)]

    def values(chosen: list[str], expires: float) -> list[bytes]:
        return [MSGPackSerializer.dumps(signed_value(signer, name_key(n), PublishedModel(
            n, "cd" * 32, 1000, 2000, time.time()).payload(), expires)) for n in chosen]

    batches = [(names[start:start + 256], values(names[start:start + 256], expiration))  # signed once for every peer
               for start in range(0, count, 256)]
    taken = []
    for peer in peers:
        count_taken = 0
        for chosen, signed in batches:
            answer = None
            for attempt in range(3):  # a request that timed out (None: a loaded machine) is sent again, a little later
                expires = expiration + attempt  # expiring later than what the lost request may have stored
                answer = await node.protocol.call_store(
                    PeerID.from_base58(peer), [DHTID.generate(source=name_key(n)) for n in chosen],
                    signed if attempt == 0 else values(chosen, expires), expires,
                    subkeys=[slot_subkey(signer)] * len(chosen))
                if answer is not None:
                    break
            count_taken += sum(answer or [])
        taken.append(count_taken)
    return taken


def test_a_name_published_after_many_learnt_keys_is_not_hidden_by_a_regular_value(network, prober):
    """The issue's attack (100,000 slots, each naming its own key, then a year-long regular value under a name
    published afterwards) at 2,000 keys: the storing peers keep a key's policy with its records, not in a table that
    overflows, so the regular value is refused and another peer reads the record."""
    taken = prober.run_coroutine(partial(_learn_many, peers=network.storing_peers, count=2_000,
                                         expiration=now() + 3600))
    assert taken == [2_000] * STORERS, taken
    name = f"after-flood-{time.monotonic_ns() % 10**9}"
    publish_weights_name(network, name)
    assert hide(prober, name_key(name), network.storing_peers, regular=True) == [False] * STORERS
    forget_local_copies(network.reader, [name_key(name)])
    assert weights_name_found(network, name)


# ----- issue 55, 2: where a reader needs one signer's entry, the signer is part of the key -------------------------
def test_stranger_slots_filling_the_shared_governance_key_do_not_stop_a_halt(network, prober):
    """The issue's attack: at peers that know no prefix (so trust no governance key), 64 slots of fresh keys fill the
    shared governance key and the real halt was refused there. Each key's decisions live under its own key, which no
    other key can write: the halt is stored and a reader trusting the key adopts it."""
    from swarm.governance.records import GovernanceState, own_governance_key
    from swarm.governance.records import publish as publish_decision

    prefix, governor = f"gov-{time.monotonic_ns() % 10**9}", Ed25519PrivateKey.generate()
    squatter = prober  # whom no reader asks: what counts is what the storing peers took
    taken = squatter.run_coroutine(partial(_squat, key=governance_key(prefix), name="x", expiration=now() + 3600,
                                           peers=network.storing_peers, count=GOVERNANCE.max_subkeys))
    assert taken == [GOVERNANCE.max_subkeys] * STORERS, "the shared key was not filled: no attack to defend"
    own = own_governance_key(prefix, ed25519_text(governor))
    assert squatter.run_coroutine(partial(_squat, key=own, name="x", expiration=now() + 3600,
                                          peers=network.storing_peers, count=4)) == [0] * STORERS, \
        "a stranger's slot was stored under another key's own governance key"
    assert publish_decision(network.writer, governor, prefix, "halt", "incident", read_back_seconds=20) is not None
    state = GovernanceState(prefix, [governor.public_key()])
    assert state.refresh(network.reader) is not None and state.halted
