"""The kill switch: signed records, unknown keys, replays; and a halt stopping a live generation."""
from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarm.governance.keys import generate_private_key, load_private_key, parse_public_key, public_key_text
from swarm.governance.records import HALT, RESUME, GovernanceState, governance_subkey, sign_decision


def record(key, prefix, action, reason, sequence, timestamp=None):
    """(subkey, value, expiration) as a reader gets them from the DHT."""
    expiration = time.time() + 3600
    value = sign_decision(key, prefix, action, reason, sequence, expiration, timestamp)
    return governance_subkey(key), value, expiration


def test_key_files_round_trip_and_are_not_overwritten(tmp_path):
    path = tmp_path / "gov.key"
    key = generate_private_key(path)
    assert public_key_text(load_private_key(path)) == public_key_text(key)
    assert public_key_text(parse_public_key(public_key_text(key))) == public_key_text(key)
    with pytest.raises(FileExistsError):
        generate_private_key(path)
    with pytest.raises(ValueError, match="Ed25519"):
        parse_public_key("not a key")


def test_valid_halt_is_adopted_and_newer_resume_wins():
    key = Ed25519PrivateKey.generate()
    state = GovernanceState("model", [key.public_key()])
    halt = record(key, "model", HALT, "incident", sequence=1, timestamp=time.time() - 10)
    assert state.consider(*halt).halted and state.halted
    resume = record(key, "model", RESUME, "fixed", sequence=2, timestamp=time.time() - 5)
    state.consider(*resume)
    assert not state.halted
    # A replay of the old halt changes nothing, for a reader that saw the resume or one that reads both.
    assert state.consider(*halt) is None and not state.halted
    for order in ([resume, halt], [halt, resume]):
        fresh = GovernanceState("model", [key.public_key()])
        for entry in order:
            fresh.consider(*entry)
        assert not fresh.halted and fresh.current.sequence == 2
    # The sequence decides, not the clock; and the signature covers the expiration the record was stored with.
    late_halt = record(key, "model", HALT, "clock skew", sequence=1, timestamp=time.time())
    assert state.consider(*late_halt) is None and not state.halted
    subkey, value, expiration = halt
    assert GovernanceState("model", [key.public_key()]).consider(subkey, value, expiration + 3600) is None


def test_unknown_key_bad_signature_wrong_prefix_and_future_are_ignored():
    trusted, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    state = GovernanceState("model", [trusted.public_key()])
    assert state.consider(*record(other, "model", HALT, "x", 1)) is None
    _, forged, expiration = record(other, "model", HALT, "x", 1)
    assert state.consider(governance_subkey(trusted), forged, expiration) is None, "another key's signature"
    assert state.consider(*record(trusted, "other-model", HALT, "x", 1)) is None
    assert state.consider(*record(trusted, "model", HALT, "x", 1, timestamp=time.time() + 3600)) is None
    slot = governance_subkey(trusted)
    assert state.consider(slot, {"payload": b"junk", "signature": b"junk"}, expiration) is None
    assert state.consider(slot, "not a record", expiration) is None
    _, valid, expiration = record(trusted, "model", HALT, "x", 1)
    assert state.consider(f"{public_key_text(trusted)}|halt", valid, expiration) is None, "the old slot format"
    assert not state.halted


# ----- with live servers ------------------------------------------------------------------------------
import torch  # noqa: E402

from swarm.client import DistributedDiffusionLM  # noqa: E402
from swarm.dht.node import NetworkConfig, start_dht, stop_dht  # noqa: E402
from swarm.dht.schema import default_prefix  # noqa: E402
from swarm.governance.records import governance_key, publish  # noqa: E402
from swarm.protocol import ErrorCode, ForwardRequest, RemoteError  # noqa: E402
from tests.conftest import make_checkpoint, tiny_config  # noqa: E402

SETTINGS = dict(gen_length=16, steps=16, block_length=8, seed=2)


@pytest.fixture(scope="module")
def governed(local_swarm, tmp_path_factory):
    """A model served by one server that trusts a governance key; an operator DHT peer to publish with."""
    root = tmp_path_factory.mktemp("governed")
    key = generate_private_key(root / "gov.key")
    path = make_checkpoint(root / "model", tiny_config(), seed=6)
    server = local_swarm.start_server(str(path), "0:4", "--compute-threads", "1",
                                      "--governance-key", public_key_text(key))
    operator = start_dht(NetworkConfig(initial_peers=local_swarm.initial_peers, client_mode=True))
    yield path, key, server, operator
    stop_dht(operator)
    local_swarm.terminate(server)


def wait_for(condition, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def test_halt_stops_generation_before_next_step_then_resume_and_replay(local_swarm, governed):
    path, key, server, operator = governed
    prefix = default_prefix(path)
    with DistributedDiffusionLM.from_pretrained(path, initial_peers=local_swarm.initial_peers,
                                                governance_keys=(public_key_text(key),)) as lm:
        steps = []
        for chunk in lm.generate_stream("halt me", **SETTINGS):
            if chunk.done:
                result = chunk.result
                break
            steps.append(chunk.step)
            if chunk.step == 2:
                assert publish(operator, key, prefix, HALT, "incident 42", timestamp=time.time() - 1)
        assert result.finish_reason == "halted"
        assert result.info["halt"]["reason"] == "incident 42" and result.info["halt"]["step"] == 3
        assert steps == [0, 1, 2], "not a single step after the halt"

        # The server refuses new steps too, with a distinct error.
        hidden = torch.randn(1, 4, tiny_config().hidden_size)
        def refused() -> bool:
            try:
                lm.loop.run(lm.caller.forward(server.peer_id, ForwardRequest(0, 4, hidden), 10))
                return False
            except RemoteError as error:
                return error.code == ErrorCode.HALTED
        assert wait_for(refused), "server did not refuse while halted"

        slot = governance_subkey(key)
        old_halt = operator.get(governance_key(prefix), latest=True).value[slot]
        assert publish(operator, key, prefix, RESUME, "fixed", timestamp=time.time())
        assert wait_for(lambda: not refused())
        assert lm.generate("after resume", **SETTINGS).finish_reason != "halted"

        # Replaying the old halt record (same signed bytes, later or same expiration) is refused and changes nothing.
        for expiration in (time.time() + 3600, old_halt.expiration_time):
            assert not operator.store(governance_key(prefix), old_halt.value, expiration, subkey=slot)
        assert lm.generate("after replay", **SETTINGS).finish_reason != "halted"


def test_halt_signed_with_another_key_changes_nothing(local_swarm, governed, tmp_path):
    path, key, server, operator = governed
    intruder = generate_private_key(tmp_path / "intruder.key")
    assert publish(operator, intruder, default_prefix(path), HALT, "not yours", timestamp=time.time() + 1)
    with DistributedDiffusionLM.from_pretrained(path, initial_peers=local_swarm.initial_peers,
                                                governance_keys=(public_key_text(key),)) as lm:
        result = lm.generate("still running", **SETTINGS)
    assert result.finish_reason != "halted" and result.steps == 16


# ----- safety tiers and the audit log -------------------------------------------------------------------
from swarm.governance.tiers import TierRules  # noqa: E402


def test_tier_rules_classify_and_only_tighten(tmp_path):
    rules = TierRules()
    assert rules.classify("Once upon a time") == "public"
    assert rules.classify("This memo is CONFIDENTIAL") == "internal"
    assert rules.classify("my password is hunter2, confidential") == "restricted"
    assert rules.classify("Once upon a time", requested="internal") == "internal"
    assert rules.classify("my password is x", requested="public") == "restricted", "never looser"
    with pytest.raises(ValueError, match="unknown tier"):
        rules.classify("x", requested="secret")
    custom = tmp_path / "rules.json"
    custom.write_text('{"rules": [{"tier": "internal", "pattern": "quarterly"}], '
                      '"policies": {"public": {"spot_check_fraction": 0.5}}}')
    loaded = TierRules.from_file(custom)
    assert loaded.classify("quarterly numbers") == "internal" and loaded.classify("password") == "public"
    assert loaded.policies["public"].spot_check_fraction == 0.5


def test_restricted_request_uses_only_trusted_servers_and_is_audited(local_swarm, governed, tmp_path):
    path, key, server, operator = governed
    audit = tmp_path / "audit.jsonl"
    with DistributedDiffusionLM.from_pretrained(path, initial_peers=local_swarm.initial_peers,
                                                audit_log=str(audit)) as lm:
        with pytest.raises(ValueError, match="trusted_peers"):
            lm.generate("my password is hunter2", **SETTINGS)
        lm.client_config.trusted_peers = (server.peer_id,)
        result = lm.generate("my password is hunter2", **SETTINGS)
        assert result.info["tier"] == "restricted"
        assert all(server.peer_id[-8:] in hop for hop in result.info["route"])
        assert result.info["spot_checks"], "restricted requests are always spot-checked (or say why not)"
        public = lm.generate("a story", **SETTINGS)
        assert public.info["tier"] == "public" and not public.info["spot_checks"]
    import json

    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [r["tier"] for r in records] == ["restricted", "public"]
    assert records[0]["route"] and records[0]["finish_reason"] in ("eos", "length")


def test_client_without_keys_still_ends_cleanly_when_a_server_refuses_as_halted(local_swarm, governed):
    path, key, server, operator = governed
    assert publish(operator, key, default_prefix(path), HALT, "server-side halt", timestamp=time.time())
    try:
        with DistributedDiffusionLM.from_pretrained(path, initial_peers=local_swarm.initial_peers) as lm:
            def halted_result():
                return lm.generate("x", **SETTINGS).finish_reason == "halted"
            assert wait_for(halted_result)
            result = lm.generate("x", **SETTINGS)
            assert "server-side halt" in result.info["halt"]["reason"] and result.info["halt"]["step"] == 0
    finally:
        assert publish(operator, key, default_prefix(path), RESUME, "done", timestamp=time.time() + 0.5)
