"""Attacks on the DHT records by a peer with no keys, replayed against the live local swarm (issue 16, items 1-2).

The attacker runs a plain hivemind DHT peer with only hivemind's stock ``RSASignatureValidator`` (what every
peer ran before): it keeps whatever it forges in its own storage and pushes it to every honest peer. Each test
shows the attack is real (the old reader would have believed it, or the write would have landed), then that
honest peers refuse it at storage where they can, that readers ignore it when they meet it on the attacker's
own peer, and that clients, the health map and the operator's commands still work.
"""
from __future__ import annotations

import time
from functools import partial

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht import DHT, DHTNode
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

from swarm.client import DistributedDiffusionLM
from swarm.dht.compatibility import CompatibilityTag
from swarm.dht.identity import Identity
from swarm.dht.node import NetworkConfig, start_dht, stop_dht
from swarm.dht.schema import (
    ExpertRecord,
    ServerRecord,
    ServerState,
    block_key,
    declare_experts,
    default_prefix,
    expert_index_key,
    now,
    read_expert_domains,
    read_expert_records,
    read_servers,
)
from swarm.dht.validation import OwnerBindingValidator, SignedSlotValidator, described_key, owner_peer_id
from swarm.governance.__main__ import main as governance_cli
from swarm.governance.guard import GovernanceGuard
from swarm.governance.keys import generate_private_key, public_key_text
from swarm.governance.records import HALT, RESUME, governance_key, governance_subkey, sign_decision
from swarm.health import read_health_map

SETTINGS = dict(gen_length=16, steps=16, block_length=8, seed=2)
FORTY_DAYS = 40 * 24 * 3600.0


def legacy_peer_id(subkey: bytes) -> str:
    """How readers took the peer id from a subkey before this fix (kept to show each attack was real)."""
    return subkey.decode("utf-8", errors="replace").split("[owner:", 1)[0]


# ----- the attacker's tools (run inside its DHT process) -----------------------------------------------
def _record(node: DHTNode, key: str, subkey, value, expiration: float) -> bytes:
    """The value bytes a peer sends: serialised and, if the attacker's key is in the subkey, signed by it."""
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                       MSGPackSerializer.dumps(value), expiration)
    return node.protocol.record_validator.sign_value(record)


async def _forge(dht: DHT, node: DHTNode, key: str, subkey, value, expiration: float, peers: list[str],
                 raw: bool = False, in_cache: bool = False) -> list:
    """Keep the record in the attacker's own storage and push it to each peer (into its cache with ``in_cache``,
    as hivemind's readers do with what they found); each peer's answer."""
    value_bytes = value if raw else _record(node, key, subkey, value, expiration)
    node.protocol.storage.store_subkey(DHTID.generate(source=key), subkey, value_bytes, expiration)
    answers = []
    for peer in peers:
        for _ in range(3):  # None: no answer in time (busy cores); ask again
            answer = await node.protocol.call_store(PeerID.from_base58(peer), [DHTID.generate(source=key)],
                                                    [value_bytes], expiration, subkeys=[subkey], in_cache=in_cache)
            if answer is not None:
                break
        answers.append(answer[0] if answer else None)
    return answers


async def _held_by(dht: DHT, node: DHTNode, peer: str, key: str) -> dict:
    """{subkey: (signed value bytes, expiration)} that ``peer`` holds under ``key``."""
    found = await node.protocol.call_find(PeerID.from_base58(peer), [DHTID.generate(source=key)])
    entry = found[DHTID.generate(source=key)][0] if found else None
    if entry is None or not hasattr(entry.value, "items"):
        return {}
    return {subkey: (item.value, item.expiration_time) for subkey, item in entry.value.items()}


def holders(attacker: DHT, peers: list[str], key: str) -> list[str]:
    """The peers holding a record under ``key`` whose value names the key (so they know its policy)."""
    return [peer for peer in peers
            if any(described_key(value) == key for value, _ in held_by(attacker, peer, key).values())]


def forge(attacker: DHT, key: str, subkey, value, expiration: float, peers: list[str], raw: bool = False,
          in_cache: bool = False) -> list:
    return attacker.run_coroutine(partial(_forge, key=key, subkey=subkey, value=value, expiration=expiration,
                                          peers=peers, raw=raw, in_cache=in_cache))


def held_by(attacker: DHT, peer: str, key: str) -> dict:
    return attacker.run_coroutine(partial(_held_by, peer=peer, key=key))


# ----- fixtures -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def attacker(local_swarm):
    dht = DHT(initial_peers=local_swarm.initial_peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
              record_validators=[RSASignatureValidator()])
    yield dht
    stop_dht(dht)


@pytest.fixture(scope="module")
def client(local_swarm, tiny_model_path):
    """A client that re-reads the server list before every generation, as a new client would."""
    with DistributedDiffusionLM.from_pretrained(tiny_model_path, initial_peers=local_swarm.initial_peers,
                                                route_refresh=0.0, request_timeout=20) as lm:
        yield lm


def honest_peers(local_swarm) -> list[str]:
    return [p.peer_id for p in local_swarm.processes if p.alive and p.peer_id]


def victim_of(local_swarm):
    """The only server of block 0: lose it and no client can route."""
    return next(p for p in local_swarm.processes if p.alive and p.span == (0, 2))


def announced(client, prefix: str) -> set[str]:
    """Peer ids the health map lists (before an attack: servers of this or earlier tests, all real)."""
    return {record.peer_id for record in read_health_map(client.dht, prefix, 4).servers}


def assert_swarm_unharmed(local_swarm, attacker, client, local_lm, prefix: str, victim, before: set[str]) -> None:
    """Clients route with the same tokens as one process; the health map and every reader see the victim; the
    attack added no record for a peer that does not exist (``before``: what was listed before it)."""
    remote = client.generate("still routed", **SETTINGS)
    assert remote.token_ids == local_lm.generate("still routed", **SETTINGS).token_ids
    health = read_health_map(client.dht, prefix, 4)
    listed = {record.peer_id: record for record in health.servers}
    assert health.fully_served and listed[victim.peer_id].state == ServerState.ONLINE
    assert set(listed) <= {p.peer_id for p in local_swarm.processes} | before, "a record for a peer that does not exist"
    for reader in (client.dht, attacker):  # the attacker's own peer holds the forgery: the reader must drop it
        assert read_servers(reader, prefix, 4)[victim.peer_id].state == ServerState.ONLINE


# ----- server records -----------------------------------------------------------------------------------
def test_unsigned_offline_record_under_a_victims_peer_id_is_ignored(local_swarm, attacker, client, local_lm,
                                                                    tiny_model_path):
    prefix, victim = default_prefix(tiny_model_path), victim_of(local_swarm)
    before = announced(client, prefix)
    forged = ServerRecord(victim.peer_id, ServerState.OFFLINE, 0, 2, 1.0).to_value()
    subkey = victim.peer_id.encode()
    for block in (0, 1):  # the issue's attack, verbatim, then pushed to every honest peer
        attacker.store(block_key(prefix, block), forged, now() + 600, subkey=subkey)
        peers = honest_peers(local_swarm)
        held = holders(attacker, peers, block_key(prefix, block))
        answers = dict(zip(peers, forge(attacker, block_key(prefix, block), subkey, forged, now() + 600, peers)))
        # The model's servers refuse plain subkeys under its keys (tests/test_security_dht.py); a peer that knows no
        # model (the bootstrap peer) refuses them once it holds a record naming the key (swarm.dht.keys,
        # tests/test_security_keys.py), and may keep them before. The old reader took them for the victim.
        assert legacy_peer_id(subkey) == victim.peer_id
        assert not any(answers[p.peer_id] for p in local_swarm.processes[1:4])
        assert held and not any(answers[p] for p in held)
    assert owner_peer_id(subkey) is None
    assert_swarm_unharmed(local_swarm, attacker, client, local_lm, prefix, victim, before)


def test_record_signed_by_another_key_under_a_victims_peer_id_is_refused(local_swarm, attacker, client, local_lm,
                                                                         tiny_model_path):
    prefix, victim = default_prefix(tiny_model_path), victim_of(local_swarm)
    before = announced(client, prefix)
    forged = ServerRecord(victim.peer_id, ServerState.OFFLINE, 0, 2, 1.0).to_value()
    own_key = RSASignatureValidator().local_public_key  # the attacker's process-wide key: the one its DHT signs with
    subkey = victim.peer_id.encode() + own_key
    attacker.store(block_key(prefix, 0), forged, now() + 600, subkey=subkey)
    answers = forge(attacker, block_key(prefix, 0), subkey, forged, now() + 600, honest_peers(local_swarm))
    # hivemind's signature check alone passes it (the attacker did sign it) and the old reader named the victim;
    # the owner key does not derive the victim's peer id, so every honest peer refuses it.
    assert legacy_peer_id(subkey) == victim.peer_id and owner_peer_id(subkey) is None
    assert answers == [False] * len(answers)
    for peer in honest_peers(local_swarm):
        assert subkey not in held_by(attacker, peer, block_key(prefix, 0))
    assert_swarm_unharmed(local_swarm, attacker, client, local_lm, prefix, victim, before)


def test_replayed_server_record_is_refused(local_swarm, attacker, client, local_lm, tiny_model_path):
    """The victim's own signed record, replayed with a later expiration or under another block: refused."""
    prefix, victim = default_prefix(tiny_model_path), victim_of(local_swarm)
    before = announced(client, prefix)
    held = {}
    for peer in honest_peers(local_swarm):
        held.update(held_by(attacker, peer, block_key(prefix, 0)))
    subkey = next(s for s in held if owner_peer_id(s) == victim.peer_id)
    value, expiration = held[subkey]
    peers = honest_peers(local_swarm)
    refused = [False] * len(peers)
    assert forge(attacker, block_key(prefix, 0), subkey, value, expiration + 3600, peers, raw=True) == refused
    assert forge(attacker, block_key(prefix, 3), subkey, value, expiration, peers, raw=True) == refused
    assert_swarm_unharmed(local_swarm, attacker, client, local_lm, prefix, victim, before)


def test_validators_refuse_forged_subkeys_without_a_network():
    identity = Identity.load_or_create(None)
    try:
        other = RSASignatureValidator(RSAPrivateKey())
        record = partial(DHTRecord, DHTID.generate(source="m.0").to_bytes(), value=b"\x80", expiration_time=1e10)
        check = OwnerBindingValidator().validate
        assert check(record(MSGPackSerializer.dumps(identity.owner_subkey())))
        assert not check(record(MSGPackSerializer.dumps(identity.peer_id.encode() + other.local_public_key)))
        assert not check(record(MSGPackSerializer.dumps(identity.owner_subkey() + b"x")))
        assert check(record(MSGPackSerializer.dumps(other.local_public_key))), "hivemind-style owner-only subkey"
        assert check(record(MSGPackSerializer.dumps(b"plain"))) and check(record(MSGPackSerializer.dumps(7)))
        assert not SignedSlotValidator().validate(record(MSGPackSerializer.dumps("[ed25519:junk]")))
    finally:
        identity.remove()
    assert not identity.path.exists()


# ----- expert records -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def expert_announcer(local_swarm):
    """An honest peer announcing an expert the way servers do: its identity signs the records."""
    identity = Identity.load_or_create(None)
    dht = start_dht(NetworkConfig(initial_peers=local_swarm.initial_peers), identity=identity)
    record = ExpertRecord(identity.peer_id, "guarded", ServerState.ONLINE, CompatibilityTag("byte-v1", 260, 259), 5.0)
    assert declare_experts(dht, "security", [record], identity.owner_subkey(), now() + 600)
    yield identity.peer_id
    stop_dht(dht)


def test_forged_expert_records_and_index_are_ignored(local_swarm, attacker, client, expert_announcer):
    victim, peers = expert_announcer, honest_peers(local_swarm)
    offline = ExpertRecord(victim, "guarded", ServerState.OFFLINE, CompatibilityTag("byte-v1", 260, 259), 1.0)
    evil = ExpertRecord(victim, "evil", ServerState.ONLINE, CompatibilityTag("byte-v1", 260, 259), 1.0)
    entry = {"record_version": 1, "experts": [offline.to_value(), evil.to_value()]}
    for subkey, refused in ((victim.encode(), False), (victim.encode() + RSASignatureValidator().local_public_key,
                                                       True)):
        # No peer here knows the prefix "security": a plain subkey is refused by the peers holding the announcer's
        # record, whose value names its key (they have learnt the key's policy), and may be stored by the others; a
        # subkey with another peer's id before one's own key is refused by all.
        held = holders(attacker, peers, expert_index_key("security"))
        answers = dict(zip(peers, forge(attacker, expert_index_key("security"), subkey, entry, now() + 600, peers)))
        assert legacy_peer_id(subkey) == victim and held and not any(answers[p] for p in held)
        assert not refused or not any(answers.values())
    for reader in (client.dht, attacker):
        records = read_expert_records(reader, "security", "guarded")
        assert set(records) == {victim} and records[victim].state == ServerState.ONLINE
        assert read_expert_domains(reader, "security") == {"guarded"}
        announced = read_health_map(reader, "security", 1).experts
        assert [a.peer_id for a in announced["guarded"]] == [victim] and "evil" not in announced


# ----- governance -------------------------------------------------------------------------------------
def run_cli(*args: str) -> str:
    result = CliRunner().invoke(governance_cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_junk_and_replays_cannot_bring_back_a_halt_and_resume_succeeds(local_swarm, attacker, client, local_lm,
                                                                        tiny_model_path, tmp_path):
    prefix, peers = default_prefix(tiny_model_path), honest_peers(local_swarm)
    key = generate_private_key(tmp_path / "gov.key")
    public, slot, gov_key = public_key_text(key), governance_subkey(key), governance_key(prefix)
    network = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
    operator = ["--key", str(tmp_path / "gov.key"), "--dht-prefix", prefix, *network]
    assert "halt #" in run_cli("halt", *operator, "--reason", "incident")
    guard = GovernanceGuard(client.dht, prefix, [public])
    assert guard.current(force=True).halted
    old_halt = {}
    for peer in peers:
        old_halt.update(held_by(attacker, peer, gov_key))
    halt_bytes, halt_expiration = old_halt[slot]

    # The issue's attack: junk in the old resume slot (a plain subkey). The model's servers refuse it at storage;
    # so does every peer holding the halt, which names its key (the bootstrap peer knows no model, but has learnt the
    # key's policy from it). Readers never look at junk anyway.
    servers = [p.peer_id for p in local_swarm.processes if p.alive and p.span]
    held = holders(attacker, peers, gov_key)
    junk = dict(zip(peers, forge(attacker, gov_key, f"{public}|resume", {"junk": 1}, now() + FORTY_DAYS, peers)))
    assert held and not any(junk[p] for p in servers + held)
    # Junk in the real slot, and the old halt replayed with a later expiration: every honest peer refuses both.
    assert forge(attacker, gov_key, slot, {"junk": 1}, now() + FORTY_DAYS, peers) == [False] * len(peers)
    assert forge(attacker, gov_key, slot, halt_bytes, halt_expiration + FORTY_DAYS, peers, raw=True) == \
        [False] * len(peers)
    # A stranger's halt in its own slot, with an enormous sequence, is stored but trusted by nobody.
    stranger, expiration = Ed25519PrivateKey.generate(), now() + 600
    halt = sign_decision(stranger, prefix, HALT, "not yours", 2**62, expiration)
    assert attacker.store(gov_key, halt, expiration, subkey=governance_subkey(stranger))

    assert "resume #" in run_cli("resume", *operator, "--reason", "fixed")
    for reader in (client.dht, attacker):  # the attacker's peer still holds the replayed halt: ignored
        fresh = GovernanceGuard(reader, prefix, [public])
        decision = fresh.current(force=True)
        assert decision is None or decision.action == RESUME
    decision = GovernanceGuard(client.dht, prefix, [public]).current(force=True)
    assert decision.action == RESUME and decision.sequence > guard.state.current.sequence
    assert guard.current(force=True).action == RESUME
    # A fresh reader merges what the peers it reaches answer; under load a store can miss one of the key's holders,
    # which then answers the (older, lower-sequence) halt alone until a later read also reaches a peer holding the
    # resume. A replay that won would make every read say "halted"; eventual consistency lets a later read say
    # "running" (seen once in a loaded run: the first status read reached only such a peer).
    deadline = time.monotonic() + 30
    while True:
        status = CliRunner().invoke(governance_cli, ["status", "--governance-key", public, "--dht-prefix", prefix,
                                                     *network])
        if (status.exit_code == 0 and "running: last resume" in status.output) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert status.exit_code == 0 and "running: last resume" in status.output, status.output
    # a client trusting the key, on the file's client's DHT peer (one of its own is a DHT process and a daemon,
    # ~1 CPU s): its guard checks the slots it reads whatever peer reads them, as the attacker's reads above show
    with DistributedDiffusionLM.from_pretrained(tiny_model_path, dht=client.dht, governance_keys=(public,)) as governed:
        result = governed.generate("resumed", **SETTINGS)
    assert result.finish_reason != "halted"
    assert result.token_ids == local_lm.generate("resumed", **SETTINGS).token_ids


def test_identity_file_is_the_servers_signing_key(tmp_path):
    """``--identity-path``: the same peer id every start, proven by the records; only temporary ones are removed."""
    path = tmp_path / "server.id"
    first, again = Identity.load_or_create(path), Identity.load_or_create(path)
    assert first.fresh and not again.fresh and not again.temporary and first.peer_id == again.peer_id
    assert owner_peer_id(again.owner_subkey()) == first.peer_id
    again.remove()
    assert path.exists(), "a persistent identity is the operator's file"
    temporary = Identity.load_or_create(None)
    assert temporary.temporary and temporary.path.exists()
    temporary.remove()
    assert not temporary.path.parent.exists()
    ed25519 = tmp_path / "ed25519.id"
    ed25519.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=b"x" * 64).SerializeToString())
    with pytest.raises(ValueError, match="RSA identity"):
        Identity.load_or_create(ed25519)


def test_records_with_unusable_values_are_ignored():
    """A signed record is still remote input: a NaN or infinite throughput (every route through it would cost NaN),
    a public name or expert names that are not text are refused whole; long texts are cut."""
    from swarm.dht.schema import MAX_NAME_CHARS, ExpertRecord

    good = ServerRecord("peer", ServerState.ONLINE, 0, 2, 10.0, public_name="alice", experts=["code"]).to_value()
    assert ServerRecord.from_value("peer", good) is not None
    for change in ({"throughput": float("nan")}, {"throughput": float("inf")}, {"throughput": -1.0},
                   {"public_name": 7}, {"public_name": ["a"]}, {"experts": "code"}, {"experts": [1]},
                   {"experts": ["x"] * 1000}):
        assert ServerRecord.from_value("peer", dict(good, **change)) is None, change
    long = ServerRecord.from_value("peer", dict(good, public_name="n" * 10_000, experts=["e" * 10_000]))
    assert len(long.public_name) == MAX_NAME_CHARS and len(long.experts[0]) == MAX_NAME_CHARS
    expert = {"record_version": good["record_version"], "domain": "code", "state": 1, "throughput": float("nan"),
              "tag": {"tokenizer": "byte", "vocab_size": 260, "mask_token_id": 259}}
    assert ExpertRecord.from_value("peer", expert) is None
