"""Stream records (swarm/improve/stream_records.py): a coordinator's signed streams, read only through the reader's
trusted coordinators; a stranger's, forged, oversized or malformed record is none, and a stream claiming nodes it was
not given or that did no work is flagged; swarm.health and the web map show them (issue 57)."""
from __future__ import annotations

import dataclasses
import functools
import json
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage
from hivemind.utils import MSGPackSerializer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.dht.keys import STREAMS, policy_for
from swarm.dht.schema import now
from swarm.dht.validation import ed25519_text, protect_storage, sign_slot, slot_subkey, verify_slot
from swarm.improve.stream_records import (
    MAX_RECORD_BYTES,
    StreamEntry,
    StreamRecord,
    record_of,
    streams_key,
)

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
COORDINATOR, STRANGER = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
KEY = ed25519_text(COORDINATOR)
NODES = [f"Qm{c}" for c in "abcdefgh"]


def record(sequence: int = 1, prefix: str = "p", **changes) -> StreamRecord:
    """Two streams over 8 nodes, weights 3:1: pools of 6 and 2, each claim within its pool and each node working."""
    tagged = StreamEntry("tagged", "tagged-addition", 3.0, (0.1, 0.3), tuple(NODES[:6]), tuple(NODES[:6]), (4,) * 6)
    hosts = StreamEntry("hosts", "host-blocks", 1.0, (0.5,), tuple(NODES[6:]), tuple(NODES[6:]), (2, 1))
    fields = dict(entries=(tagged, hosts), coordinator=KEY)
    fields.update(changes)
    return StreamRecord(prefix, sequence, time.time(), **fields)


def test_a_record_round_trips_and_its_streams_are_shown_unflagged():
    sent = record()
    read = StreamRecord.from_payload(sent.payload(), KEY, "p")
    assert read == sent
    views = read.views()
    assert [(v["stream"], len(v["pool"]), v["flags"], v["stalled"]) for v in views] == [
        ("tagged", 6, [], False), ("hosts", 2, [], False)]
    assert views[0]["curve"] == [0.1, 0.3] and views[0]["coordinator"] == KEY


def test_a_claim_of_nodes_not_given_or_idle_and_a_pool_the_weights_do_not_give_are_flagged():
    base = record()
    tagged, hosts = base.entries
    grabbing = StreamEntry(hosts.name, hosts.task, hosts.weight, hosts.curve, hosts.pool, (*hosts.pool, NODES[0]),
                           (2, 1, 9))
    flags = StreamRecord("p", 1, 0.0, (tagged, grabbing)).views()[1]["flags"]
    assert any("not in its pool" in flag for flag in flags), flags
    idle = StreamEntry(hosts.name, hosts.task, hosts.weight, hosts.curve, hosts.pool, hosts.pool, (2, 0))
    assert any("did no work" in flag for flag in StreamRecord("p", 1, 0.0, (tagged, idle)).views()[1]["flags"])
    greedy = StreamEntry(hosts.name, hosts.task, hosts.weight, hosts.curve, (*hosts.pool, *tagged.pool[:2]),
                         hosts.pool, (2, 1))
    shrunk = StreamEntry(tagged.name, tagged.task, tagged.weight, tagged.curve, tagged.pool[2:], tagged.pool[2:],
                         (4,) * 4)
    views = StreamRecord("p", 1, 0.0, (shrunk, greedy)).views()
    assert "pool of 4 nodes" not in views[0]["flags"][0] and "the weights give 6" in views[0]["flags"][0]
    assert "the weights give 2" in views[1]["flags"][0]


def test_a_stalled_stream_is_shown_stalled_with_no_pool_expected():
    tagged, hosts = record().entries
    stalled = StreamEntry(hosts.name, hosts.task, hosts.weight, (0.5, 0.6, 0.6, 0.5, 0.6), (), (), ())
    grown = StreamEntry(tagged.name, tagged.task, tagged.weight, tagged.curve, tuple(NODES), tuple(NODES), (1,) * 8)
    views = StreamRecord("p", 1, 0.0, (grown, stalled)).views()
    assert views[1]["stalled"] and views[1]["flags"] == [] and views[0]["flags"] == []


def test_only_the_coordinator_s_own_newest_valid_record_is_read():
    older, newer = record(1).payload(), record(2).payload()
    stranger = record(9).payload()
    assert record_of([(KEY, older), (KEY, newer)], KEY, "p").sequence == 2
    assert record_of([(ed25519_text(STRANGER), stranger), (KEY, older)], KEY, "p").sequence == 1, \
        "a stranger's slot under the coordinator's key is never its record"
    assert record_of([(ed25519_text(STRANGER), stranger)], KEY, "p") is None
    assert record_of([(KEY, record(3, prefix="other").payload())], KEY, "p") is None, "another model's record"
    future = StreamRecord("p", 4, time.time() + 3600, record().entries, coordinator=KEY)
    assert record_of([(KEY, future.payload())], KEY, "p") is None, "a record from the future"
    assert record_of([(KEY, b"\x00" * (MAX_RECORD_BYTES + 1)), (KEY, b"junk")], KEY, "p") is None


@pytest.mark.parametrize("change, says", [
    ({"entries": record().entries * 2}, "each name once"),
    ({"patience": 0}, "patience"),
])
def test_a_record_that_breaks_a_bound_is_not_written(change, says):
    with pytest.raises(ValueError, match=says):
        record(**change).payload()


def test_a_node_in_two_pools_and_an_oversized_record_are_refused():
    tagged, hosts = record().entries
    doubled = StreamEntry(hosts.name, hosts.task, hosts.weight, hosts.curve, (*hosts.pool, NODES[0]), (), ())
    with pytest.raises(ValueError, match="each in one pool"):
        StreamRecord("p", 1, 0.0, (tagged, doubled)).payload()
    body = {"record_version": 1, "prefix": "p", "sequence": 1, "published": 0.0, "patience": 3,
            "streams": [dict(tagged.to_value(), pool=[NODES[0]]), dict(hosts.to_value(), pool=[NODES[0]])]}
    with pytest.raises(ValueError, match="each in one pool"):
        StreamRecord.from_payload(MSGPackSerializer.dumps(body), KEY, "p")
    with pytest.raises(ValueError, match="at most"):
        StreamRecord.from_payload(b"\x90" * (MAX_RECORD_BYTES + 1), KEY, "p")


def test_the_key_takes_only_the_coordinator_s_slot_and_a_forged_signature_is_refused():
    key = streams_key("p", KEY)
    assert STREAMS.parts(key) == {"prefix": "p", "coordinator": KEY}
    storage, key_id, expiration = DHTLocalStorage(), DHTID.generate(source=key), now() + 600
    protect_storage([storage], {}, policy_for)

    def store(signer, payload: bytes = b"streams") -> bool:
        value = MSGPackSerializer.dumps(sign_slot(signer, key, payload, expiration))
        return storage.store_subkey(key_id, slot_subkey(signer), value, expiration)

    assert store(STRANGER) is False and store(COORDINATOR) is True and store(STRANGER) is False
    payload = record().payload()
    genuine = sign_slot(COORDINATOR, key, payload, expiration)
    assert verify_slot(key_id.to_bytes(), slot_subkey(COORDINATOR), genuine, expiration) == payload
    forged = dict(genuine, payload=record(7).payload())  # another record under the coordinator's signature
    with pytest.raises(ValueError, match="signature"):
        verify_slot(key_id.to_bytes(), slot_subkey(COORDINATOR), forged, expiration)
    assert storage.store_subkey(key_id, slot_subkey(COORDINATOR), MSGPackSerializer.dumps(forged), expiration) \
        is False


LEAVES = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=70) | \
    st.binary(max_size=70)
VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner,
                                                                                         max_size=9), max_leaves=40)
ENTRY = st.fixed_dictionaries({"name": st.sampled_from(["a", "b", "", "x" * 65, 3]),
                               "task": st.sampled_from(["t", "host-blocks", None]),
                               "weight": st.floats() | st.integers(-1, 2**60), "curve": VALUES,
                               "pool": st.lists(st.sampled_from(NODES + ["0OIl", ""]), max_size=4) | VALUES,
                               "claimed": st.lists(st.sampled_from(NODES), max_size=3) | VALUES,
                               "worked": st.lists(st.integers(-1, 5), max_size=3) | VALUES})


@FUZZ
@given(body=st.fixed_dictionaries({"record_version": st.sampled_from([1, 2, "1"]), "prefix": st.sampled_from(["p", 1]),
                                   "sequence": st.integers(-1, 2**60) | VALUES, "published": st.floats() | VALUES,
                                   "patience": st.integers(-1, 200) | VALUES,
                                   "streams": st.lists(ENTRY, max_size=4) | VALUES}) | VALUES)
def test_any_payload_parses_to_a_bounded_record_or_is_refused(body):
    try:
        payload = MSGPackSerializer.dumps(body)
    except Exception:  # noqa: BLE001 (what msgpack cannot encode no peer can send)
        return
    for data in (payload, payload[: len(payload) // 2]):
        try:
            parsed = StreamRecord.from_payload(data, KEY, "p")
        except ValueError:
            continue
        parsed.check()
        views = parsed.views()
        assert json.loads(json.dumps(views, allow_nan=False)) == views, "what a reader shows is plain JSON"


@FUZZ
@given(data=st.binary(max_size=300))
def test_any_bytes_parse_or_are_refused(data):
    try:
        StreamRecord.from_payload(data, KEY, "p")
    except ValueError:
        pass


def test_the_health_map_and_the_web_map_show_the_streams():
    from swarm.health.map import build_health_map
    from swarm.health.render import render_text
    from swarm.web.snapshot import ClientView, map_snapshot

    health = build_health_map([], "p", 4)
    tagged, hosts = record().entries
    idle = StreamEntry(hosts.name, hosts.task, hosts.weight, hosts.curve, hosts.pool, hosts.pool, (2, 0))
    health.streams = StreamRecord("p", 1, 0.0, (tagged, idle), coordinator=KEY).views()
    shown = health.to_json()["streams"]
    assert [(s["stream"], s["weight"], len(s["pool"])) for s in shown] == [("tagged", 3.0, 6), ("hosts", 1.0, 2)]
    text = render_text(health)
    assert "STREAM" in text and "tagged-addition" in text and "0.10 0.30" in text and "did no work" in text
    snapshot = map_snapshot(health, {}, ClientView(), {"enabled": False}, "health", False)
    assert snapshot["streams"][1]["flags"] and snapshot["streams"][0]["curve"] == [0.1, 0.3]
    assert json.loads(json.dumps(snapshot)) == snapshot


def test_a_coordinator_s_record_is_what_swarm_health_shows_and_no_stranger_s(local_swarm, tiny_model_path, tmp_path):
    """On the shared swarm: ``python -m swarm.improve coordinate`` publishes one round's record (weights 3:1 over 8
    given nodes: pools of 6 and 2; no version published, so no curve and no claim) and ``swarm.health --json`` of a
    reader trusting its key shows it; a stranger's slot under the coordinator's key is refused by the storing peers,
    and a stranger's own record is not read by a reader that does not trust it."""
    from click.testing import CliRunner

    from swarm.adapters.sharing import store_slot
    from swarm.dht.config import NetworkConfig
    from swarm.dht.node import start_dht, stop_dht
    from swarm.dht.schema import default_prefix
    from swarm.governance.keys import generate_private_key
    from swarm.health.__main__ import main as health
    from swarm.improve.coordinate import coordinate_main
    from swarm.improve.stream_records import publish_streams

    prefix = default_prefix(tiny_model_path)
    peers = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
    key = generate_private_key(tmp_path / "coordinator.key")
    coordinated = CliRunner().invoke(coordinate_main, [
        *peers, "--model", str(tiny_model_path), "--key", str(tmp_path / "coordinator.key"), "--stream",
        "tagged:tagged-addition:3", "--stream", "hosts:host-blocks:1", *(a for n in NODES for a in ("--node", n)),
        "--trusted-auditors", "none", "--rounds", "1", "--json"])
    assert coordinated.exit_code == 0, coordinated.output
    assert [len(v["pool"]) for v in json.loads(coordinated.stdout)] == [6, 2]
    dht = start_dht(NetworkConfig(initial_peers=local_swarm.initial_peers, client_mode=True))
    try:
        assert publish_streams(dht, STRANGER, record(9, prefix=prefix), 600)
        forged = record(10, prefix=prefix).payload()
        assert not store_slot(dht, STRANGER, streams_key(prefix, ed25519_text(key)), forged, now() + 600)
    finally:
        stop_dht(dht)
    result = CliRunner().invoke(health, [*peers, "--model", str(tiny_model_path), "--trusted-auditors", "none",
                                         "--trusted-coordinators", ed25519_text(key), "--json"])
    assert result.exit_code == 0, result.output
    streams = json.loads(result.stdout)["streams"]
    assert [(s["stream"], len(s["pool"]), s["coordinator"], s["flags"], s["curve"]) for s in streams] == [
        ("tagged", 6, ed25519_text(key), [], []), ("hosts", 2, ed25519_text(key), [], [])]


# ----- the coordinator's rules ---------------------------------------------------------------------------------------
def test_a_stream_spec_is_name_task_weight():
    from swarm.improve.coordinator import StreamSpec

    assert StreamSpec.parse("tagged:tagged-addition:3") == StreamSpec("tagged", "tagged-addition", 3.0)
    for bad in ("tagged", "tagged:t:x", "tagged:t:-1", "tagged:t:inf", ":t:1", "a:b:1:2", "a b:t:1"):
        with pytest.raises(ValueError):
            StreamSpec.parse(bad)


def test_the_curve_is_the_best_trusted_score_so_far_version_by_version():
    from swarm.improve.coordinator import audited_curve
    from swarm.reports.records import AdapterAudit, AuditBook, AuditReport

    auditor, author = ed25519_text(Ed25519PrivateKey.generate()), ed25519_text(Ed25519PrivateKey.generate())
    shas = [f"{n:x}" * 64 for n in range(1, 6)]
    scored = {shas[0]: 20, shas[2]: 10, shas[4]: 50}  # of 100; v2 not scored
    entries = tuple(AdapterAudit("s", author, sha, "host-blocks", 100, correct, 1.0) for sha, correct in scored.items())
    book = AuditBook("p", frozenset({auditor}))
    book.consider(AuditReport("p", 1, 2.0, (), auditor, entries))
    book.consider(AuditReport("p", 1, 2.0, (), ed25519_text(STRANGER), (
        AdapterAudit("s", author, shas[1], "host-blocks", 100, 100, 1.0),)))  # not trusted: never read
    assert audited_curve(book, shas, "host-blocks") == (0.2, 0.2, 0.5), "a lower score later keeps the best so far"
    assert audited_curve(book, shas, "addition") == ()


def test_pools_follow_the_weights_from_one_record_to_the_next_and_a_stray_trainer_is_flagged():
    from swarm.improve.coordinator import StreamSpec, plan_record

    specs = [StreamSpec("tagged", "tagged-addition", 3.0), StreamSpec("hosts", "host-blocks", 1.0)]
    first = plan_record("p", specs, {}, NODES, {}, 1, 0.0)
    assert [len(e.pool) for e in first.entries] == [6, 2]
    heavier = [specs[0], StreamSpec("hosts", "host-blocks", 3.0)]
    working = {e.name: {node: 1 for node in e.pool} for e in first.entries}
    second = plan_record("p", heavier, {}, NODES, working, 2, 0.0, previous=first)
    tagged, hosts = second.entries
    assert (len(tagged.pool), len(hosts.pool)) == (4, 4)
    assert set(tagged.pool) < set(first.entries[0].pool) and set(first.entries[1].pool) < set(hosts.pool), \
        "only the surplus moved"
    views = StreamRecord.from_payload(second.payload(), "", "p").views()
    flags = {v["stream"]: v["flags"] for v in views}
    assert flags["hosts"] == [] and any("not in its pool" in f for f in flags["tagged"]), \
        "tagged's trainers that were moved and still claim for it are flagged"
    stalled = plan_record("p", heavier, {"hosts": (0.5, 0.6, 0.6, 0.6, 0.6)}, NODES, {}, 3, 0.0, previous=second)
    assert [len(e.pool) for e in stalled.entries] == [8, 0], "a stalled stream gives its nodes back"
    with pytest.raises(ValueError, match="at most"):
        plan_record("p", specs, {}, [f"Qm{n}" for n in range(65)], {}, 4, 0.0)


def test_a_coordinator_writes_no_record_a_reader_would_refuse():
    tagged, hosts = record().entries
    for bad in (StreamEntry("x", "t", float("nan")), StreamEntry("x", "t", 1.0, (1.5,)), StreamEntry("x", "t", 1.0,
                pool=("Qm0OIl",)), StreamEntry("x y", "t", 1.0), StreamEntry("x", "t", 1.0, claimed=("Qma",))):
        with pytest.raises(ValueError):
            StreamRecord("p", 1, 0.0, (tagged, bad)).payload()


# ----- trainers that follow the coordinator ---------------------------------------------------------------------------
class Rounds:
    """Stands for an improver: which stream's settings each round ran with (``trained``), and its closing."""

    def __init__(self, settings, trained: list, closed: list):
        self.name, self.trained, self.closed = settings.name, trained, closed

    def run_round(self):
        self.trained.append(self.name)
        return len(self.trained)

    def close(self, close_host=True):
        self.closed.append((self.name, close_host))


def test_a_trainer_moves_to_the_stream_its_node_is_assigned_and_only_to_one_it_offers(tmp_path):
    from swarm.improve.config import ImproveConfig, StreamOffer, offers_of
    from swarm.improve.follow import Follower, stream_config, stream_for

    config = ImproveConfig("tagged-addition", "seeds-t", "tagged", "k", str(tmp_path), run_id="r",
                           stream_coordinator=KEY, also_streams=("hosts:host-blocks:seeds-hb/",))
    config.validate()
    hosts = stream_config(config, offers_of(config)[1])
    assert (hosts.name, hosts.task, hosts.data, hosts.run_id) == ("hosts", "host-blocks", "seeds-hb/", "hosts")
    assert hosts.workdir == str(tmp_path / "streams" / "hosts")
    hosts.validate()  # the settings an improver of the stream checks (the follower alone follows)
    assert stream_config(config, offers_of(config)[0]) is config, "its own stream keeps its settings"
    two = record()  # NODES[6:] in "hosts"
    assert stream_for(two, NODES[7], ["tagged", "hosts"], "tagged") == "hosts"
    assert stream_for(two, NODES[0], ["tagged", "hosts"], "hosts") == "tagged"
    assert stream_for(two, NODES[7], ["tagged"], "tagged") == "tagged", "a stream it does not offer: it stays"
    assert stream_for(two, "QmNobody", ["tagged", "hosts"], "hosts") == "hosts" and \
        stream_for(None, NODES[0], ["tagged", "hosts"], "hosts") == "hosts"
    for bad in ("hosts:host-blocks", "hosts:no-such-task:d", "tagged:host-blocks:d", "x y:host-blocks:d"):
        with pytest.raises(ValueError):
            ImproveConfig("tagged-addition", "seeds-t", "tagged", "k", str(tmp_path), stream_coordinator=KEY,
                          also_streams=(bad,)).validate()
    assert StreamOffer.parse("a:host-blocks:datasets:x:train").data == "datasets:x:train"

    records = [None, two, two, record(3, entries=(two.entries[0], dataclasses.replace(two.entries[1], pool=())))]
    trained, closed = [], []
    follower = Follower(dataclasses.replace(config, rounds=4), functools.partial(Rounds, trained=trained,
                        closed=closed), lambda: records.pop(0), NODES[7])
    assert [stream for stream, _ in follower.run()] == ["tagged", "hosts", "hosts", "hosts"]
    follower.close()
    assert sorted(closed) == [("hosts", False), ("tagged", False)], "one improver a stream; its owner closes the host"


def test_a_paced_trainer_runs_one_round_per_new_record_of_its_coordinator(tmp_path):
    """``--round-per-record``: no record, or the record its last round followed, starts no round (the coordinator
    paces the rounds); each newer one starts exactly one, on the stream it assigns; a stream it moves to keeps none
    of the follower's own settings."""
    from swarm.improve.config import ImproveConfig, offers_of
    from swarm.improve.follow import Follower, stream_config

    config = ImproveConfig("tagged-addition", "seeds-t", "tagged", "k", str(tmp_path), stream_coordinator=KEY,
                           also_streams=("hosts:host-blocks:seeds-hb/",), round_per_record=True)
    config.validate()
    hosts = stream_config(config, offers_of(config)[1])
    assert not hosts.round_per_record and hosts.stream_coordinator is None
    hosts.validate()
    with pytest.raises(ValueError, match="--round-per-record"):
        ImproveConfig("tagged-addition", "seeds-t", "tagged", "k", str(tmp_path), round_per_record=True).validate()

    first, second = record(5), record(9)  # NODES[7] is in "hosts" in both
    reads = [None, first, first, first, second, second, record(7)]  # an older record than followed starts none
    trained = []
    follower = Follower(config, functools.partial(Rounds, trained=trained, closed=[]), lambda: reads.pop(0), NODES[7])
    assert [follower.step() for _ in range(len(reads))] == [None, 1, None, None, 2, None, None]
    assert trained == ["hosts", "hosts"]
