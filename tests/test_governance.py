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
import json  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from hivemind.dht import DHT  # noqa: E402
from hivemind.utils import MSGPackSerializer, get_dht_time  # noqa: E402

from swarm.client import DistributedDiffusionLM  # noqa: E402
from swarm.dht.schema import default_prefix  # noqa: E402
from swarm.dht.validation import sign_slot  # noqa: E402
from swarm.governance.records import governance_key, publish, read_decisions  # noqa: E402
from swarm.utils.local_swarm import ManagedProcess  # noqa: E402
from swarm.wire.messages import ErrorCode, ForwardRequest, RemoteError  # noqa: E402
from tests.conftest import make_checkpoint, stop_all, tiny_config, wait_seen, wait_until  # noqa: E402

# 8 steps (a call per hop each, checked calls twice): no test here counts on more than the 4 before its halt
SETTINGS = dict(gen_length=16, steps=8, block_length=8, seed=2)


@dataclass
class Governed:
    """A model served by one server that trusts three governance keys, and an operator DHT peer."""

    path: Path
    key: Ed25519PrivateKey  # halts (and resumes)
    resumer: Ed25519PrivateKey  # a second operator: resumes while the first key's halt stays in its slot
    probe: Ed25519PrivateKey  # signs only records the server logs as invalid: shows that it polled
    server: ManagedProcess
    operator: DHT
    probes: int = 0

    @property
    def prefix(self) -> str:
        return default_prefix(self.path)

    def trusted(self, *keys: Ed25519PrivateKey) -> dict:
        return {public_key_text(k): k.public_key() for k in keys}

    def server_polled(self, times: int = 2, timeout: float = 30.0) -> bool:
        """Wait until the server has read the governance records ``times`` more times (it polls every 2 s).

        Each time the probe key stores a record for another prefix, which the server logs once when it reads it
        ("ignoring an invalid governance record: record is for prefix 'poll-probe-N'"). So every record stored
        before this call was read by the first poll; after the second, that poll has also applied what it read.
        """
        for _ in range(times):
            self.probes += 1
            name = f"poll-probe-{self.probes}"
            marker = repr(name)  # as the server's log line quotes it
            body = {"action": "probe", "reason": "", "prefix": name, "sequence": 0, "timestamp": time.time()}
            expiration = get_dht_time() + 3600 + self.probes  # later than the probe it replaces in the slot
            value = sign_slot(self.probe, governance_key(self.prefix), MSGPackSerializer.dumps(body), expiration)
            assert self.operator.store(governance_key(self.prefix), value, expiration,
                                       subkey=governance_subkey(self.probe))
            if not wait_until(lambda: any(marker in line for line in self.server.log), timeout):
                return False
        return True


@pytest.fixture(scope="module")
def governed(local_swarm, tmp_path_factory, swarm_peer) -> Governed:
    root = tmp_path_factory.mktemp("governed")
    key, resumer, probe = (generate_private_key(root / f"{name}.key") for name in ("gov", "resumer", "probe"))
    path = make_checkpoint(root / "model", tiny_config(), seed=6)
    trust = [arg for k in (key, resumer, probe) for arg in ("--governance-key", public_key_text(k))]
    server = local_swarm.start_server(str(path), "0:4", "--compute-threads", "1", *trust)
    operator = swarm_peer  # the file's clients read through it too: what they read is what it stored or found
    # As operators do when they set up keys: a server trusting them stops when it reads no decision for long.
    assert publish(operator, key, default_prefix(path), RESUME, "set-up")
    yield Governed(path, key, resumer, probe, server, operator)
    stop_all(local_swarm, [server])  # its own model's prefix


def refused(lm, server: ManagedProcess) -> bool:
    """Whether the server refuses a step now with ``halted``."""
    hidden = torch.randn(1, 4, tiny_config().hidden_size)
    try:
        lm.loop.run(lm.caller.forward(server.peer_id, ForwardRequest(0, 4, hidden), 10))
        return False
    except RemoteError as error:
        return error.code == ErrorCode.HALTED


RESUME_LIFETIME = 8.0  # seconds the second operator's resume stays on the DHT in the replay test
RPC_POLL = 0.5  # seconds between calls asking whether the server refuses (it reads the decisions every 2 s)


@pytest.fixture
def replayed(governed):
    """The test below leaves the first key's old halt in its slot: that key resumes afterwards, for the tests
    whose readers trust only it."""
    yield governed
    assert publish(governed.operator, governed.key, governed.prefix, RESUME, "replay test over",
                   trusted=[governed.resumer.public_key()])


def test_halt_stops_generation_before_next_step_then_resume_and_replay(local_swarm, replayed, swarm_peer):
    g = replayed
    keys = (public_key_text(g.key), public_key_text(g.resumer))
    with DistributedDiffusionLM.from_pretrained(g.path, dht=swarm_peer,
                                                governance_keys=keys) as lm:
        steps = []
        for chunk in lm.generate_stream("halt me", **SETTINGS):
            if chunk.done:
                result = chunk.result
                break
            steps.append(chunk.step)
            if chunk.step == 2:
                halt = publish(g.operator, g.key, g.prefix, HALT, "incident 42", timestamp=time.time() - 1)
                assert halt is not None
        assert result.finish_reason == "halted"
        assert result.info["halt"]["reason"] == "incident 42" and result.info["halt"]["step"] == 3
        assert steps == [0, 1, 2], "not a single step after the halt"

        # The server refuses new steps too, with a distinct error.
        assert wait_until(lambda: refused(lm, g.server), interval=RPC_POLL), "server did not refuse while halted"

        # The halt's signed bytes cannot be stored with another expiration (the signature covers it), so under
        # its own key a later resume, stored with a later expiration, replaces it for good
        # (tests/test_security_records.py). The replay that can reach readers is the old halt alone on the DHT
        # after a later resume: here a second operator resumes with a short-lived record, the halt stays.
        slot = governance_subkey(g.key)
        old_halt = g.operator.get(governance_key(g.prefix), latest=True).value[slot]
        assert not g.operator.store(governance_key(g.prefix), old_halt.value, time.time() + 3600, subkey=slot)
        expiration = get_dht_time() + RESUME_LIFETIME
        resume = sign_decision(g.resumer, g.prefix, RESUME, "fixed", halt.sequence + 1, expiration, time.time())
        g.operator.store(governance_key(g.prefix), resume, expiration, subkey=governance_subkey(g.resumer))
        resumed = lm.guard.current(force=True)  # the client reads it at once, before it expires
        assert resumed.action == RESUME and resumed.sequence == halt.sequence + 1
        assert wait_until(lambda: not refused(lm, g.server), timeout=RESUME_LIFETIME - 2, interval=RPC_POLL), \
            "the resume was ignored"
        assert lm.generate("after resume", **SETTINGS).finish_reason != "halted"

        trusted = g.trusted(g.key, g.resumer)
        assert wait_until(lambda: [d for d, _ in read_decisions(g.operator, g.prefix, trusted)] == [halt],
                          timeout=3 * RESUME_LIFETIME, interval=1.0), "the resume did not expire"  # DHT reads
        fresh = GovernanceState(g.prefix, trusted.values())
        assert fresh.refresh(g.operator) == halt, "a reader that never saw the resume obeys the old halt"
        # Readers that saw the resume never go back to the lower sequence.
        assert g.server_polled(), "the server did not poll the governance records"
        assert not refused(lm, g.server), "the server obeyed the replayed halt"
        after = lm.generate("after replay", **SETTINGS)
        assert after.finish_reason != "halted" and after.steps == SETTINGS["steps"]
        assert lm.guard.state.current == resumed


def test_halt_signed_with_another_key_changes_nothing(local_swarm, governed, tmp_path, swarm_peer):
    g = governed
    intruder = generate_private_key(tmp_path / "intruder.key")
    assert publish(g.operator, intruder, g.prefix, HALT, "not yours", timestamp=time.time() + 1)
    assert governance_subkey(intruder) in g.operator.get(governance_key(g.prefix), latest=True).value
    assert g.server_polled(), "the server did not poll the governance records"
    with DistributedDiffusionLM.from_pretrained(g.path, dht=swarm_peer,
                                                governance_keys=(public_key_text(g.key),)) as lm:
        assert not refused(lm, g.server), "the server obeyed a halt signed by a key it does not trust"
        result = lm.generate("still running", **SETTINGS)
    assert result.finish_reason != "halted" and result.steps == SETTINGS["steps"]


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


@pytest.fixture(scope="module")
def tiered_swarm(local_swarm, tmp_path_factory):
    """Two servers a client trusts and, announcing itself far faster, one it does not, all holding every block. The
    trusted ones announce 10 tokens/s: a route's cost is its measured round trip plus tokens over throughput, and with
    their own figure (thousands) a loaded machine's slower ping to the fast server outweighed the compute it saves."""
    path = make_checkpoint(tmp_path_factory.mktemp("tiered") / "tiered", tiny_config(), seed=8)
    servers = [local_swarm.start_server(str(path), "0:4", "--compute-threads", "1", *extra, wait=False)
               for extra in (("--throughput", "10"), ("--throughput", "10"), ("--throughput", "1e9"))]
    for server in servers:
        local_swarm.wait_ready(server)
    yield path, servers[:2], servers[2]
    stop_all(local_swarm, servers)  # their own prefix


def test_restricted_request_uses_only_trusted_servers_and_is_audited(local_swarm, tiered_swarm, tmp_path, swarm_peer):
    path, trusted, untrusted = tiered_swarm
    trusted_ids = {server.peer_id for server in trusted}
    audit = tmp_path / "audit.jsonl"
    # A long ping: on a loaded machine the fast server's first challenge may take seconds, and a missed one bans it.
    # Checks off for the public request (the default draws 5% of hops): the tiers' own floors are what is tested.
    with DistributedDiffusionLM.from_pretrained(path, dht=swarm_peer,
                                                audit_log=str(audit), connect_timeout=30, spot_check_fraction=0) as lm:
        wait_seen(lm, [*trusted, untrusted])
        with pytest.raises(ValueError, match="trusted_peers"):
            lm.generate("my password is hunter2", **SETTINGS)
        lm.client_config.trusted_peers = tuple(sorted(trusted_ids))
        public = lm.generate("a story", **SETTINGS)
        assert public.info["tier"] == "public" and public.info["spot_checks"] == []
        assert [hop[:8] for hop in public.info["route"]] == [untrusted.peer_id[-8:]], "the fastest, when allowed"

        result = lm.generate("my password is hunter2", **SETTINGS)
        assert result.info["tier"] == "restricted"
        route = [hop[:8] for hop in result.info["route"]]
        assert route and set(route) <= {peer[-8:] for peer in trusted_ids}, route
        # Every hop of every call re-run on another trusted server, and the two agreed.
        checks = result.info["spot_checks"]
        assert len(checks) == result.denoiser_calls * len(route)
        for check in checks:
            assert check["verdict"] == "agreed", check
            assert check["primary"] in trusted_ids and set(check["checkers"]) == trusted_ids - {check["primary"]}

    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [r["tier"] for r in records] == ["public", "restricted"]
    assert records[1]["route"] == result.info["route"] and records[1]["spot_checks"] == checks
    assert records[1]["finish_reason"] in ("eos", "length")


def test_restricted_request_with_a_single_trusted_holder_stops_unverified(local_swarm, tiered_swarm, swarm_peer):
    """One trusted holder leaves no server to check its answers against: a restricted request stops, it does not
    return tokens nobody verified; unless the client holds the blocks itself and recomputes every hop (issue 48)."""
    from swarm.client.spot_check import UnverifiedResultError

    path, trusted, _ = tiered_swarm
    with DistributedDiffusionLM.from_pretrained(path, dht=swarm_peer,
                                                trusted_peers=(trusted[0].peer_id,), spot_check_local=False) as lm:
        with pytest.raises(UnverifiedResultError, match="two trusted peers"):
            lm.generate("my password is hunter2", **SETTINGS)
        assert lm.generate("a story", **SETTINGS).info["tier"] == "public"  # other tiers are unaffected
    with DistributedDiffusionLM.from_pretrained(path, dht=swarm_peer,
                                                trusted_peers=(trusted[0].peer_id,)) as lm:
        result = lm.generate("my password is hunter2", **SETTINGS)
        checks = result.info["spot_checks"]
        assert result.info["tier"] == "restricted" and checks and result.info["unchecked"] == 0
        assert {(c["verdict"], tuple(c["checkers"])) for c in checks} == {("agreed", ("local",))}, checks


def test_client_without_keys_still_ends_cleanly_when_a_server_refuses_as_halted(local_swarm, governed, swarm_peer):
    g = governed
    assert publish(g.operator, g.key, g.prefix, HALT, "server-side halt", timestamp=time.time())
    try:
        assert g.server_polled(), "the server did not poll the governance records"
        with DistributedDiffusionLM.from_pretrained(g.path, dht=swarm_peer) as lm:
            result = lm.generate("x", **SETTINGS)
            assert result.finish_reason == "halted"
            assert "server-side halt" in result.info["halt"]["reason"] and result.info["halt"]["step"] == 0
    finally:  # resumed, and read by the server, before the next test (whichever it is) asks it for a step
        assert publish(g.operator, g.key, g.prefix, RESUME, "done", timestamp=time.time() + 0.5)
        assert g.server_polled(), "the server did not poll the governance records"
