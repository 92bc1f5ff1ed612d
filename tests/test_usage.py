"""Use management (issue 39 item 4): the per-caller ledger and its share mark (swarm/server/usage.py), the retry hint
on the wire and in the client's bans. Unit tests: no process, no socket; the swarm test is in tests/test_usage_swarm.py.
"""
import math

import msgpack
import pytest

from swarm.server.usage import BUCKETS, UsageLedger
from swarm.utils.settings import SettingError
from swarm.wire.encoding import check_error, error_response
from swarm.wire.messages import MAX_RETRY_AFTER_S, ErrorCode, RemoteError, retry_hint


def test_counts_tokens_seconds_and_requests_per_caller_and_in_total():
    ledger = UsageLedger()
    ledger.record("A", tokens=100, seconds=0.5, now=1000.0)
    ledger.record("A", tokens=50, seconds=0.25, now=1001.0)
    ledger.record("B", tokens=10, seconds=0.1, now=1002.0)
    info = ledger.info(now=1003.0)
    assert info["total"]["tokens"] == 160 and info["total"]["requests"] == 3
    assert info["total"]["seconds"] == pytest.approx(0.85)
    assert info["in_window"]["tokens"] == 160
    first, second = info["callers"]
    assert (first["peer_id"], first["tokens"], first["requests"]) == ("A", 150, 2)
    assert first["seconds"] == pytest.approx(0.75) and first["window_seconds"] == pytest.approx(0.75)
    assert (second["peer_id"], second["tokens"]) == ("B", 10)
    assert first["first"] == 1000.0 and first["last"] == 1001.0
    msgpack.packb(info)  # rpc_info sends it as is


def test_the_window_slides_and_totals_stay():
    ledger = UsageLedger(window=60.0)
    ledger.record("A", 100, 1.0, now=0.0)
    ledger.record("A", 100, 1.0, now=50.0)
    assert ledger.info(now=55.0)["in_window"]["tokens"] == 200
    info = ledger.info(now=70.0)  # the first call left the window, the second is in it
    assert info["in_window"]["tokens"] == 100 and info["callers"][0]["window_tokens"] == 100
    assert info["total"]["tokens"] == 200 and info["callers"][0]["tokens"] == 200
    info = ledger.info(now=200.0)
    assert info["in_window"] == {"tokens": 0, "seconds": 0} and info["callers"][0]["window_seconds"] == 0


def test_no_cap_by_default():
    ledger = UsageLedger()
    ledger.record("heavy", 10_000, 50.0, now=0.0)
    ledger.record("light", 1, 0.001, now=0.0)
    assert not ledger.over_share("heavy", now=1.0)


def test_a_caller_over_its_share_is_only_marked_for_the_scheduler_and_never_refused():
    """Issue 48 item 5: the share is an order (the scheduler serves an over-share caller after the others), so the
    ledger counts no refusal whatever the use."""
    ledger = UsageLedger(max_share=0.5, window=60.0)
    for second in range(10):
        ledger.record("heavy", 1000, 1.0, now=float(second))
    ledger.record("light", 10, 0.1, now=9.5)
    assert ledger.over_share("heavy", now=10.0) and not ledger.over_share("light", now=10.0)
    assert not ledger.over_share("unknown", now=10.0)
    info = ledger.info(now=10.0)
    assert info["refused"] == 0 and all(entry["refused"] == 0 for entry in info["callers"])


def test_once_the_others_left_the_window_the_heavy_caller_is_within_its_share_again():
    ledger = UsageLedger(max_share=0.5, window=10.0)
    ledger.record("heavy", 1000, 5.0, now=0.0)
    ledger.record("light", 10, 0.1, now=1.0)
    ledger.record("heavy", 1000, 5.0, now=1.0)
    assert ledger.over_share("heavy", now=2.0)
    ledger.record("light", 10, 1.0, now=14.0)  # heavy's calls have left the 10 s window, light's new one is in it
    assert not ledger.over_share("heavy", now=14.5) and ledger.over_share("light", now=14.5)


def test_callers_tracked_are_bounded_and_a_flood_of_ids_keeps_the_totals():
    ledger = UsageLedger(max_callers=8, top=4, window=60.0)
    ledger.record("regular", 1000, 1.0, now=0.0)
    for index in range(10_000):  # a stranger cycling peer ids
        ledger.record(f"sybil-{index}", 1, 0.0001, now=1.0 + index * 0.001)
    info = ledger.info(now=20.0)
    assert info["callers_tracked"] == 8 and len(ledger.callers) == 8
    assert info["callers_forgotten"] == 10_000 + 1 - 8
    assert len(info["callers"]) == 4
    assert info["total"]["tokens"] == 11_000 and info["total"]["requests"] == 10_001
    assert all(len(entry.window.buckets) <= BUCKETS + 1 for entry in ledger.callers.values())


def test_a_callers_window_holds_a_bounded_number_of_buckets():
    ledger = UsageLedger(max_share=0.5, window=16.0)
    for index in range(10_000):
        ledger.record("busy", 1, 0.001, now=index * 0.01)
        if index % 100 == 0:
            ledger.over_share("busy", now=index * 0.01)
    ledger.over_share("other", now=100.0)
    assert len(ledger.callers["busy"].window.buckets) <= BUCKETS + 1
    assert len(ledger.total.window.buckets) <= BUCKETS + 1


def test_a_clock_that_goes_back_keeps_the_buckets_in_order_and_bounded():
    ledger = UsageLedger(max_share=0.5, window=16.0)
    for index in range(1000):
        ledger.record("a", 1, 0.01, now=100.0 - index * 0.5 if index % 2 else 100.0 + index * 0.01)
    starts = [start for start, _, _ in ledger.callers["a"].window.buckets]
    assert starts == sorted(starts) and len(starts) <= BUCKETS + 1
    assert ledger.info(now=110.0)["total"]["requests"] == 1000


def test_rpc_info_lists_the_heaviest_callers_only():
    ledger = UsageLedger(top=32)
    for index in range(100):
        ledger.record(f"peer-{index:03d}", tokens=index, seconds=0.0, now=0.0)
    callers = ledger.info(now=1.0)["callers"]
    assert len(callers) == 32 and callers[0]["peer_id"] == "peer-099" and callers[-1]["tokens"] == 68


def test_bad_settings_are_refused():
    for kwargs in ({"max_share": 0.0}, {"max_share": 1.5}, {"window": 0.0}, {"max_callers": 0}):
        with pytest.raises(ValueError):
            UsageLedger(**kwargs)
    from swarm.server.config import ServerConfig

    with pytest.raises(SettingError, match="max_share_per_caller"):
        ServerConfig(max_share_per_caller=0.0)
    with pytest.raises(SettingError, match="share_window"):
        ServerConfig(share_window=0.5)
    assert ServerConfig().max_share_per_caller == 1.0 and ServerConfig().share_window == 60.0


# ----- the retry hint on the wire ------------------------------------------------------------------------------
def test_a_busy_answer_carries_its_retry_hint_and_the_client_reads_it():
    response = error_response(RemoteError(ErrorCode.BUSY, "server busy: over its share", retry_after=7.25))
    metadata = msgpack.unpackb(response.metadata)
    assert metadata["error"] == {"code": "busy", "message": "server busy: over its share", "retry_after": 7.25}
    with pytest.raises(RemoteError) as raised:
        check_error(metadata, "peer")
    assert raised.value.code == ErrorCode.BUSY and raised.value.retry_after == 7.25
    plain = msgpack.unpackb(error_response(RemoteError(ErrorCode.BUSY, "full")).metadata)
    assert "retry_after" not in plain["error"]  # byte for byte what it was without a hint


@pytest.mark.parametrize("value", [None, -1, 0, math.nan, math.inf, MAX_RETRY_AFTER_S + 1, "5", True, [5], {}])
def test_a_hostile_retry_hint_is_ignored(value):
    assert retry_hint(value) is None
    with pytest.raises(RemoteError) as raised:
        check_error({"error": {"code": "busy", "message": "x", "retry_after": value}})
    assert raised.value.retry_after is None


def test_a_non_map_error_is_still_an_error():
    with pytest.raises(RemoteError) as raised:
        check_error({"error": "oops"})
    assert raised.value.code == ErrorCode.INTERNAL and "oops" in str(raised.value)


def test_the_client_avoids_a_busy_server_for_its_hint_at_most_ban_max():
    from swarm.client.config import ClientConfig
    from swarm.client.peers import PeerHealth

    health = PeerHealth(ClientConfig())
    assert health.record_failure("p", "busy", busy=True) == pytest.approx(ClientConfig().backoff_base)
    assert health.record_failure("q", "busy", busy=True, retry_after=12.0) == pytest.approx(12.0)
    assert health.record_failure("r", "busy", busy=True, retry_after=10_000.0) == ClientConfig().ban_max


# ----- what readers (swarm.health --usage) take from a server's rpc_info --------------------------------------
def test_readers_parse_the_counts_bounded_and_refuse_malformed_ones():
    from swarm.server.usage import parse_usage

    ledger = UsageLedger(max_share=0.5, top=40)
    for index in range(40):
        ledger.record(f"peer-{index}", 10 + index, 0.01, now=0.0)
    parsed = parse_usage(ledger.info(now=1.0))
    assert parsed["total"]["tokens"] == sum(10 + i for i in range(40)) and len(parsed["callers"]) == 32
    assert parsed["max_share"] == 0.5 and parsed["callers"][0]["peer_id"] == "peer-39"
    good = ledger.info(now=1.0)
    for bad in (None, [], "x", {}, {**good, "total": {"tokens": -1, "seconds": 0, "requests": 0}},
                {**good, "max_share": math.nan}, {**good, "callers": [{"peer_id": 5}]}, {**good, "callers": "x"},
                {**good, "refused": True}, {**good, "in_window": {"tokens": 1, "seconds": math.inf}},
                {**good, "total": {"tokens": 2**80, "seconds": 0, "requests": 0}}):
        assert parse_usage(bad) is None, bad
    long_id = parse_usage({**good, "callers": [{**good["callers"][0], "peer_id": "Q" * 10_000}]})
    assert len(long_id["callers"][0]["peer_id"]) == 64


def test_the_health_map_shows_usage_as_text_and_json():
    from swarm.dht.schema import ServerRecord, ServerState
    from swarm.health.map import build_health_map
    from swarm.health.render import render_text
    from swarm.server.usage import parse_usage

    records = [ServerRecord(peer_id=peer, state=ServerState.ONLINE, start=0, end=4, throughput=100.0)
               for peer in ("QmServerA", "QmServerB")]
    health = build_health_map(records, "m", 4)
    assert "usage" not in health.to_json()["servers"][0] and "SHARE CAP" not in render_text(health)
    ledger = UsageLedger(max_share=0.5)
    ledger.record("12D3KooWheavyheavy", 900, 1.0, now=0.0)
    ledger.record("12D3KooWlightlight", 100, 0.1, now=0.0)
    health.usage = {"QmServerA": parse_usage(ledger.info(now=1.0)), "QmServerB": None}
    text = render_text(health)
    assert "SHARE CAP" in text and "50% of 60 s, 0 refused" in text and "...avyheavy 90%" in text
    assert "no answer" in text
    servers = {entry["peer_id"]: entry["usage"] for entry in health.to_json()["servers"]}
    assert servers["QmServerA"]["total"]["tokens"] == 1000 and servers["QmServerB"] is None
