"""Audit reports (issue 39): the signed record round-trips, and refuses malformed, oversized, forged, replayed and
strangers' input; readers follow only the auditors they name. In process, no network (the swarm tests of the
auditor are in tests/test_audit_swarm.py)."""
from __future__ import annotations

import asyncio
import json
import math
import time
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import MSGPackSerializer, get_dht_time
from hypothesis import given
from hypothesis import strategies as st

from swarm.adapters.sharing import PublishedAdapter
from swarm.audit.auditor import calibrate
from swarm.client.config import ClientConfig
from swarm.client.peers import PeerHealth
from swarm.client.planner import RoutePlanner
from swarm.client.routing import find_route
from swarm.dht.schema import MAX_AUDIT_VALUE_BYTES, ServerRecord, ServerState, audit_key, protected_keys
from swarm.dht.validation import ed25519_text, entry_bytes, sign_slot, slot_subkey
from swarm.governance.keys import ENV_PUBLIC_KEYS, generate_private_key
from swarm.reports.adoption import best_adapter
from swarm.reports.records import (
    ERROR,
    FAIL,
    MAX_ADAPTERS,
    MAX_REASON_CHARS,
    MAX_REPORT_BYTES,
    MAX_SERVERS,
    PASS,
    AdapterAudit,
    AuditBook,
    AuditReport,
    ServerAudit,
    read_report,
    trusted_auditors,
)
from tests.test_security_parsers import FUZZ, junk, mutated, strict_json

AUDITOR, STRANGER = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
A, S = ed25519_text(AUDITOR), ed25519_text(STRANGER)
PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
NOW = time.time()


def entry(peer: str = PEER, verdict: str = PASS, when: float = NOW - 10, **changes: Any) -> ServerAudit:
    base = dict(peer_id=peer, start=0, end=4, passed=1, failed=0, errors=0, first_check=when - 100, last_check=when,
                verdict=verdict, last_failure=None, reason="", announced=1e9, measured=812.5, rtt=0.002,
                seconds=0.05, rows=40)
    if verdict == FAIL:
        base.update(failed=1, last_failure=when, reason="wrong hidden states")
    if verdict == ERROR:
        base.update(errors=1, measured=None, seconds=None, reason="timeout")
    return ServerAudit(**{**base, **changes})


def report(*servers: ServerAudit, sequence: int = 1, prefix: str = "m", auditor: str = A) -> AuditReport:
    return AuditReport(prefix, sequence, NOW, tuple(servers or (entry(),)), auditor)


class FakeDHT:
    """What ``signed_entries`` reads: ``get(key, latest=True).value`` is ``{subkey: item(value, expiration)}``."""

    def __init__(self):
        self.keys: dict[str, dict] = {}

    def put(self, key: str, subkey: Any, value: Any, expiration: float) -> None:
        self.keys.setdefault(key, {})[subkey] = SimpleNamespace(value=value, expiration_time=expiration)

    def get(self, key: str, latest: bool = False):
        return SimpleNamespace(value=self.keys[key]) if key in self.keys else None

    def run_coroutine(self, coroutine):
        """``swarm.dht.schema.read_entries`` runs its read in the DHT process: here, on a node over these keys."""
        async def get_many(keys, sufficient_expiration_time=None):
            return {key: self.get(key) for key in keys}

        node = SimpleNamespace(get_many=get_many, protocol=SimpleNamespace(storage=None, cache=None))
        return asyncio.run(coroutine(self, node))


def signed(dht: FakeDHT, signer: Ed25519PrivateKey, payload: bytes, prefix: str = "m", owner: str = A,
           subkey_key: Ed25519PrivateKey | None = None) -> None:
    """Store ``payload`` signed by ``signer`` under ``owner``'s report key, in the slot of ``subkey_key``."""
    expiration = get_dht_time() + 600
    dht.put(audit_key(prefix, owner), slot_subkey(subkey_key or signer),
            sign_slot(signer, audit_key(prefix, owner), payload, expiration), expiration)


# ----- the value type ---------------------------------------------------------------------------------
def test_a_report_round_trips_through_its_signed_slot():
    original = report(entry(usage=(655772, 1.99, 48)), entry("QmOther", FAIL), entry("QmThird", ERROR))
    dht = FakeDHT()
    signed(dht, AUDITOR, original.payload())
    assert read_report(dht, "m", A) == original
    assert strict_json(original.to_json())


def test_a_full_report_fits_the_bounds():
    """The largest report an auditor writes (32 servers, the longest reasons and peer ids, counts of billions) is
    under the payload bound, and its signed value under what peers store for the key."""
    servers = [entry(f"Qm{i:0126d}", FAIL, reason="r" * MAX_REASON_CHARS, passed=2**31, errors=2**31, rows=2**20,
                     last_check=NOW, last_failure=NOW, first_check=NOW - 1e6, usage=(2**50, 1.23456789e11, 2**50),
                     calibrated=1.23456789e11)
               for i in range(MAX_SERVERS)]
    payload = report(*servers).payload()
    assert len(payload) <= MAX_REPORT_BYTES
    value = MSGPackSerializer.dumps(sign_slot(AUDITOR, audit_key("m", A), payload, get_dht_time() + 60))
    assert entry_bytes(slot_subkey(AUDITOR), value) <= MAX_AUDIT_VALUE_BYTES + 100
    print(f"a full report: {len(payload)} bytes of payload, {len(value)} bytes signed")


def test_encoding_refuses_what_readers_would_refuse():
    with pytest.raises(ValueError, match="at most 32"):
        report(*[entry(f"Qm{i}") for i in range(MAX_SERVERS + 1)]).payload()
    with pytest.raises(ValueError, match="once"):
        report(entry(), entry()).payload()
    with pytest.raises(ValueError, match="over the bound"):
        report(*[entry(f"Qm{i}", reason="x" * 2000) for i in range(MAX_SERVERS)]).payload()


@pytest.mark.parametrize("change, why", [
    ({"verdict": "maybe"}, "unknown verdict"),
    ({"verdict": FAIL}, "not among the counted"),
    ({"passed": -1}, "integer"),
    ({"passed": True}, "integer"),
    ({"measured": math.inf}, "finite"),
    ({"measured": math.nan}, "finite"),
    ({"announced": -1.0}, "finite"),
    ({"last_check": NOW + 3600}, "finite number"),  # from the future
    ({"first_check": NOW}, "first check is after"),
    ({"last_failure": NOW - 50}, "goes with failed checks"),
    ({"blocks": [4, 4]}, "bad span"),
    ({"blocks": [0, 2**60]}, "integer"),
    ({"peer_id": ""}, "peer id"),
    ({"peer_id": "Q" * 129}, "peer id"),
    ({"peer_id": b"Qm"}, "text"),
    ({"reason": None}, "text"),
    ({"usage": [1, 2]}, "usage must"),
    ({"usage": "1,2,3"}, "usage must"),
    ({"usage": [-1, 0.0, 0]}, "integer"),
    ({"usage": [0, math.nan, 0]}, "finite"),
    ({"usage": [0, 0.0, 2**60]}, "integer"),
    ({**{f"x{i}": 1 for i in range(10)}}, "at most 20 fields"),
])
def test_each_malformed_field_is_refused(change, why):
    value = entry().to_value()
    value.update(change)
    payload = MSGPackSerializer.dumps({"record_version": 1, "prefix": "m", "sequence": 1, "published": NOW,
                                       "servers": [value]})
    with pytest.raises(ValueError, match=why):
        AuditReport.from_payload(payload, A, "m")
    dht = FakeDHT()
    signed(dht, AUDITOR, payload)
    assert read_report(dht, "m", A) is None  # readers: no report, never an exception


def test_reports_for_another_model_dated_ahead_or_oversized_are_refused():
    with pytest.raises(ValueError, match="prefix"):
        AuditReport.from_payload(report(prefix="other").payload(), A, "m")
    late = AuditReport("m", 1, NOW - 3600, (entry(),), A)  # a check dated after its report
    with pytest.raises(ValueError, match="after the report"):
        AuditReport.from_payload(late.payload(), A, "m")
    with pytest.raises(ValueError, match="at most"):
        AuditReport.from_payload(b"x" * (MAX_REPORT_BYTES + 1), A, "m")
    body = {"record_version": 1, "prefix": "m", "sequence": 1, "published": NOW, "servers": [entry().to_value()] * 33}
    with pytest.raises(ValueError, match="at most 32"):
        AuditReport.from_payload(MSGPackSerializer.dumps(body), A, "m")


def check_report_body(body: Any) -> None:
    """A body signed by the trusted auditor itself (the worst case: a careless or hostile auditor)."""
    try:
        payload = MSGPackSerializer.dumps(body)
    except Exception:  # msgpack cannot carry it: nobody can store it either
        return
    if len(payload) > MAX_REPORT_BYTES:
        return  # over the slot's bound: refused by every peer before a reader sees it
    dht = FakeDHT()
    signed(dht, AUDITOR, payload)
    found = read_report(dht, "m", A)
    if found is None:
        return
    assert len(found.servers) <= MAX_SERVERS and found.prefix == "m" and found.auditor == A
    for server in found.servers:
        assert server.verdict in (PASS, FAIL, ERROR) and 0 <= server.start < server.end
        assert len(server.reason) <= MAX_REASON_CHARS and 0 < len(server.peer_id) <= 128
        for number in (server.first_check, server.last_check, server.announced, server.measured, server.rtt,
                       server.calibrated, server.overclaim):
            assert number is None or (math.isfinite(number) and number >= 0)
    book = AuditBook("m", frozenset({A}))
    book.consider(found)
    book.failed()
    book.calibrated()
    strict_json(found.to_json())


FULL_ENTRY = entry(usage=(655772, 1.99, 48), calibrated=500.0).to_value()  # every field a server entry may have
BODY = {"record_version": 1, "prefix": "m", "sequence": 5, "published": NOW, "servers": [FULL_ENTRY]}


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(BODY)), junk, min_size=1, max_size=3))
def test_report_fields_fuzzed(changes):
    check_report_body(mutated(BODY, changes))


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(FULL_ENTRY)), junk, min_size=1, max_size=4))
def test_server_entry_fields_fuzzed(changes):
    check_report_body(mutated(BODY, {"servers": [mutated(FULL_ENTRY, changes)]}))


@FUZZ
@given(junk)
def test_whole_report_payloads_fuzzed(body):
    check_report_body(body)


def test_junk_values_in_the_slot_never_raise():
    dht = FakeDHT()
    for value in (None, 1, b"x", {"payload": 1, "signature": 2}, {"payload": b"x" * 100_000, "signature": b""}):
        for subkey in (slot_subkey(AUDITOR), b"plain", 7, None):
            dht.put(audit_key("m", A), subkey, value, get_dht_time() + 60)
            assert read_report(dht, "m", A) is None


# ----- forged, strangers', replayed -----------------------------------------------------------------------
def test_a_forged_or_strangers_report_is_never_read_as_the_auditors():
    liar = report(entry(verdict=FAIL), auditor=S).payload()
    dht = FakeDHT()
    signed(dht, STRANGER, liar, subkey_key=AUDITOR)  # signed by the stranger, placed in the auditor's slot
    assert read_report(dht, "m", A) is None
    dht = FakeDHT()
    signed(dht, STRANGER, liar)  # the stranger's own slot under the auditor's key
    assert read_report(dht, "m", A) is None
    dht = FakeDHT()
    signed(dht, STRANGER, liar, owner=S)  # the stranger's own key: read only by those who trust it
    assert read_report(dht, "m", S) is not None
    book = AuditBook("m", frozenset({A}))
    book.refresh(dht)
    assert book.reports == {} and book.failed() == {}
    assert not book.consider(AuditReport.from_payload(liar, S, "m"))


def test_a_report_moved_to_another_key_fails_its_signature():
    """The signature covers the DHT key: a report signed for model 'other' cannot be stored under 'm'."""
    payload = report(prefix="m").payload()
    expiration = get_dht_time() + 600
    dht = FakeDHT()
    dht.put(audit_key("m", A), slot_subkey(AUDITOR), sign_slot(AUDITOR, audit_key("other", A), payload, expiration),
            expiration)
    assert read_report(dht, "m", A) is None


def test_an_older_report_never_replaces_a_newer_one():
    book = AuditBook("m", frozenset({A}))
    newer = report(entry(verdict=PASS), sequence=10)
    older = report(entry(verdict=FAIL), sequence=9)
    assert book.consider(newer) and not book.consider(older) and not book.consider(newer)
    assert book.failed() == {}


def test_the_most_recent_check_by_any_trusted_auditor_decides():
    other_key = Ed25519PrivateKey.generate()
    other = ed25519_text(other_key)
    book = AuditBook("m", frozenset({A, other}))
    book.consider(report(entry(verdict=FAIL, when=NOW - 100)))
    assert PEER in book.failed() and "wrong hidden states" in book.failed()[PEER]
    book.consider(report(entry(verdict=PASS, when=NOW - 5), auditor=other))  # a later pass by another
    assert book.failed() == {} and book.latest()[PEER][0] == other
    book.consider(report(entry(verdict=ERROR, when=NOW - 1), sequence=2))  # an error is no verdict on honesty
    assert book.failed() == {}


def test_storing_peers_keep_only_the_auditors_slot_under_its_key():
    policy = next(p for p in protected_keys("m", 4, auditors=[A]) if p.name == audit_key("m", A))
    assert policy.refusal(slot_subkey(AUDITOR), 1000) is None
    assert "no process here trusts" in policy.refusal(slot_subkey(STRANGER), 1000)
    assert "bytes" in policy.refusal(slot_subkey(AUDITOR), MAX_AUDIT_VALUE_BYTES + 1)
    assert policy.max_subkeys == 1
    governed = [p.name for p in protected_keys("m", 4, governance_signers=[A])]
    assert audit_key("m", A) in governed, "the governance keys' report keys are protected by default"


# ----- whom readers trust --------------------------------------------------------------------------------------
def test_trusted_auditors_default_to_the_governance_keys_and_none_trusts_nobody(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_PUBLIC_KEYS, raising=False)
    assert trusted_auditors() == []
    monkeypatch.setenv(ENV_PUBLIC_KEYS, A)
    assert trusted_auditors() == [A]
    assert trusted_auditors((), (S,)) == [S]  # the client's governance keys, when it has some
    assert trusted_auditors(("none",)) == []
    key_file = tmp_path / "auditor.key"
    public = tmp_path / "auditor.key.pub"
    public.write_text(ed25519_text(generate_private_key(key_file)) + "\n")
    assert trusted_auditors((str(public), f"{A},{S}")) == sorted({public.read_text().strip(), A, S})
    with pytest.raises(ValueError, match="not an Ed25519 public key"):
        trusted_auditors(("not-a-key",))
    with pytest.raises(ValueError, match="cannot go with keys"):
        trusted_auditors(("none", A))
    assert ClientConfig(trusted_auditors=("none",)).trusted_auditors == ("none",)


def test_a_failed_audit_excludes_a_peer_until_a_later_read_clears_it():
    health = PeerHealth(ClientConfig())
    health.audit_failures({PEER: "auditor X failed it"})
    assert not health.usable(PEER) and PEER in health.excluded()
    assert health.usable("QmOther")
    health.audit_failures({})
    assert health.usable(PEER)


def test_calibration_names_the_server_that_claims_more_than_its_peers_for_the_same_delivery():
    """Delivered figures sit below announced ones by the wire's cost (honest servers here deliver 4-6x what they
    announce); the server that announces as much as its peers while delivering a tenth is over the client's factor,
    the honest ones (a little faster or slower) are not, and a lone server is never an overclaim."""
    delivered = {"honest1": 5000.0, "honest2": 4000.0, "slow": 500.0, "fast": 6000.0}
    announced = {"honest1": 1000.0, "honest2": 1000.0, "slow": 1000.0, "fast": 1200.0}
    calibrated = calibrate(delivered, announced)
    ratios = {peer: announced[peer] / figure for peer, figure in calibrated.items()}
    factor = ClientConfig().overclaim_factor
    assert [peer for peer, ratio in ratios.items() if ratio > factor] == ["slow"]
    assert ratios["slow"] > 8 and all(0.8 < ratios[peer] < 1.2 for peer in ("honest1", "honest2", "fast"))
    assert calibrate({"alone": 10.0}, {"alone": 1e9}) == {"alone": 1e9}
    assert calibrate({}, announced) == {} and calibrate({"gone": 1.0}, {}) == {}
    assert entry(calibrated=100.0, announced=1000.0).overclaim == 10.0 and entry().overclaim is None
    assert entry(calibrated=0.0).overclaim == 1e9 / 1e-3  # finite whatever an auditor writes


def test_the_auditor_forgets_servers_it_no_longer_checks():
    """Peer ids that come and go (a stranger announcing a new fake server for every round) do not pile up in the
    auditor: what was not checked within a report's lifetime is dropped, with its speeds."""
    from swarm.audit.auditor import Auditor
    from swarm.audit.config import AuditorConfig

    config = AuditorConfig(every=60.0)
    old, recent = entry("QmOld", when=NOW - config.report_lifetime - 1), entry("QmRecent", when=NOW - 1)
    auditor = SimpleNamespace(config=config, audits={"QmOld": old, "QmRecent": recent},
                              speeds={"QmOld": [1.0], "QmRecent": [2.0]})
    Auditor.forget_old(auditor, NOW)
    assert list(auditor.audits) == ["QmRecent"] and list(auditor.speeds) == ["QmRecent"]


def test_a_client_routes_an_overclaiming_server_by_its_calibrated_throughput():
    """A full-span server announcing 10x what its delivery is worth wins the route on its claim; with a trusted
    report's calibration the client routes it by the calibrated figure (and says so), and the two honest halves win;
    a server within the factor keeps its own figure."""
    planner = RoutePlanner(None, None, None, "m", 16, 8, ClientConfig())
    servers = {"QmA": ServerRecord("QmA", ServerState.ONLINE, 0, 8, 1000.0),
               "QmB": ServerRecord("QmB", ServerState.ONLINE, 8, 16, 1000.0),
               "QmSlow": ServerRecord("QmSlow", ServerState.ONLINE, 0, 16, 1000.0)}
    hops = lambda: [hop.peer_id for hop in find_route(planner.servers, 16, latencies={p: 0.01 for p in servers})]  # noqa: E731
    planner.servers = dict(servers)
    assert hops() == ["QmSlow"]
    planner._calibrate({"QmSlow": (A, 100.0), "QmA": (A, 900.0), "QmGone": (A, 1.0)})
    assert hops() == ["QmA", "QmB"]
    assert planner.overclaimed == {"QmSlow": 10.0}
    assert planner.servers["QmSlow"].throughput == 100.0 and planner.servers["QmA"].throughput == 1000.0
    planner.servers = dict(servers)  # the next read of the records: the calibration is applied again, not stacked
    planner._calibrate({})
    assert planner.overclaimed == {} and hops() == ["QmSlow"]


def test_the_health_map_shows_the_latest_trusted_audit():
    from swarm.dht.schema import ServerRecord, ServerState
    from swarm.health.map import build_health_map
    from swarm.health.render import render_text
    from swarm.reports.records import audit_json

    book = AuditBook("m", frozenset({A}))
    book.consider(report(entry(verdict=FAIL)))
    health = build_health_map([ServerRecord(PEER, ServerState.ONLINE, 0, 4, 1e9)], "m", 4)
    health.audits = {PEER: audit_json(book.latest(), PEER)}
    shown = json.loads(strict_json(health.to_json()))
    assert shown["servers"][0]["audit"]["verdict"] == FAIL and shown["servers"][0]["audit"]["auditor"] == A
    assert "FAIL 1/2" in render_text(health) and "OVERCLAIMS" not in render_text(health)
    book.consider(report(entry(announced=1000.0, calibrated=100.0), sequence=2))  # passes, announces 10x its worth
    health.audits = {PEER: audit_json(book.latest(), PEER)}
    assert json.loads(strict_json(health.to_json()))["servers"][0]["audit"]["overclaim"] == 10.0
    assert "pass 1/1" in render_text(health) and "OVERCLAIMS 10.0x" in render_text(health)


# ----- adapter scores -----------------------------------------------------------------------------------------
def score(name: str = "adder", sha: str = "a" * 64, correct: int = 16, examples: int = 20, claimed=0.1,
          when: float = NOW - 5, author: str = S, task: str = "addition") -> AdapterAudit:
    return AdapterAudit(name, author, sha, task, examples, correct, when, claimed)


def published(name: str, sha: str, claimed: float, author: str = S) -> PublishedAdapter:
    return PublishedAdapter(name, sha, 10, {"vocab_size": 4096}, score=claimed, author=author)


def test_adapter_scores_round_trip_and_bound():
    original = AuditReport("m", 3, NOW, (entry(),), A, (score(), score("other", "b" * 64, claimed=None)))
    dht = FakeDHT()
    signed(dht, AUDITOR, original.payload())
    assert read_report(dht, "m", A) == original
    strict_json(original.to_json())
    with pytest.raises(ValueError, match="at most 16"):
        AuditReport("m", 1, NOW, (), A, tuple(score(sha=f"{i:064x}") for i in range(MAX_ADAPTERS + 1))).payload()
    with pytest.raises(ValueError, match="once per task"):
        AuditReport("m", 1, NOW, (), A, (score(), score())).payload()


@pytest.mark.parametrize("change, why", [
    ({"name": "no spaces"}, "adapter name"), ({"author": "x"}, "Ed25519"), ({"sha256": "A" * 64}, "sha256"),
    ({"task": ""}, "task name"), ({"examples": 0}, "integer"), ({"correct": 21}, "integer"),
    ({"claimed": math.nan}, "finite"), ({"checked": NOW + 3600}, "finite"),
])
def test_each_malformed_adapter_field_is_refused(change, why):
    body = dict(BODY, adapters=[dict(score().to_value(), **change)])
    with pytest.raises(ValueError, match=why):
        AuditReport.from_payload(MSGPackSerializer.dumps(body), A, "m")


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(score().to_value())), junk, min_size=1, max_size=4))
def test_adapter_entry_fields_fuzzed(changes):
    body = dict(BODY, adapters=[mutated(score().to_value(), changes)])
    check_report_body(body)
    try:
        found = AuditReport.from_payload(MSGPackSerializer.dumps(body), A, "m")
    except Exception:  # refused (or msgpack cannot carry it): readers see no report
        return
    for adapter in found.adapters:
        assert 0 <= adapter.score <= 1 and len(adapter.task) <= 32 and math.isfinite(adapter.checked)
        strict_json(adapter.to_json())


def test_best_adapter_follows_trusted_scores_not_claims():
    """Two adapters, one claiming 0.99 and scoring 9/20, one claiming 0.1 and scoring 16/20: the second is best.
    Scores of another content (a republished name), of another task or of an untrusted auditor count for nothing."""
    book = AuditBook("m", frozenset({A}))
    book.consider(AuditReport("m", 1, NOW, (), A, (score("boaster", "a" * 64, 9, claimed=0.99),
                                                     score("modest", "b" * 64, 16, claimed=0.1),
                                                     score("old", "c" * 64, 20, task="other"))))
    catalog = [published("boaster", "a" * 64, 0.99), published("modest", "b" * 64, 0.1),
               published("old", "d" * 64, 1.0)]
    record, auditor, best = best_adapter(book, "addition", catalog)
    assert record.name == "modest" and auditor == A and best.score == 0.8
    assert best.reference == f"modest@{record.author_id}"
    assert best_adapter(book, "other", catalog) is None, "the scored content of 'old' is no longer published"
    assert best_adapter(book, "addition", catalog[:1])[0].name == "boaster"
    assert not book.consider(AuditReport("m", 9, NOW, (), S, (score("boaster", "a" * 64, 20),)))  # untrusted
    assert best_adapter(book, "addition", catalog)[0].name == "modest"
