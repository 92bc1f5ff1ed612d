"""The health map: coverage arithmetic on synthetic records, and ``python -m swarm.health`` on the live swarm."""
from __future__ import annotations

import json

from click.testing import CliRunner, Result

import swarm
from swarm.dht.schema import ServerRecord, ServerState, default_prefix
from swarm.health import build_health_map
from swarm.health.__main__ import EXIT_NOT_SERVED, main
from swarm.health.render import render_text
from swarm.utils.errors import EXIT_USAGE
from swarm.utils.text import plural
from tests.conftest import make_checkpoint, tiny_config


def record(peer_id: str, start: int, end: int, state: ServerState = ServerState.ONLINE) -> ServerRecord:
    return ServerRecord(peer_id, state, start, end, throughput=100.0, public_name=f"name-{peer_id}", version="0.1.0")


def run_health(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def peers_args(local_swarm) -> list[str]:
    return [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]


# ----- without a network ---------------------------------------------------------------------------------
def test_only_online_servers_cover_blocks():
    servers = [record("d", 6, 8, ServerState.JOINING), record("b", 1, 4), record("a", 0, 2),
               record("c", 4, 6, ServerState.OFFLINE)]
    health = build_health_map(servers, "m", 8)
    assert [r.peer_id for r in health.servers] == ["a", "b", "c", "d"]  # sorted by span
    assert health.replicas == [1, 2, 1, 1, 0, 0, 0, 0]
    assert health.uncovered == [(4, 8)]
    assert not health.fully_served
    assert health.replica_runs() == [((0, 1), 1), ((1, 2), 2), ((2, 4), 1), ((4, 8), 0)]
    text = render_text(health)
    assert "NOT FULLY SERVED" in text and "4:8" in text and "offline" in text and "joining" in text


def test_full_coverage_and_json_shape():
    health = build_health_map({"a": record("a", 0, 3), "b": record("b", 2, 5)}, "m", 4)  # b reaches past 4
    assert health.fully_served and health.replicas == [1, 1, 2, 1]
    data = json.loads(json.dumps(health.to_json()))
    assert data["fully_served"] and data["uncovered"] == []
    assert data["servers"][0] == {"peer_id": "a", "public_name": "name-a", "start": 0, "end": 3, "state": "online",
                                  "throughput": 100.0, "version": "0.1.0", "cache_tokens_left": 0, "experts": [],
                                  "numerics": "exact", "approximate": False, "addresses": [],
                                  "reachability": "unknown", "head": False, "adapter_kinds": [],
                                  "audit": None,  # no trusted auditor read: docs/AUDIT.md
                                  "unreachable_since": None}  # it answered the map's probe (or none was made)
    assert "OK: every block" in render_text(health)


def test_a_server_that_does_not_answer_the_probe_is_listed_and_not_counted():
    # Issue 56: a killed server's record outlives it; the map asks each online server, as a client does.
    health = build_health_map({"a": record("a", 0, 3), "b": record("b", 2, 4)}, "m", 4)
    health.mark_unreachable({"b": 1_700_000_000.0, "nobody": 1.0})
    assert health.unreachable == {"b": 1_700_000_000.0}, "only servers the map lists"
    assert health.replicas == [1, 1, 1, 0] and health.uncovered == [(3, 4)]
    text = render_text(health)
    assert "unreachable since 22:13:20 UTC" in text and "NOT FULLY SERVED: no online server holds blocks 3:4" in text
    assert health.to_json()["servers"][1]["unreachable_since"] == 1_700_000_000.0


def test_servers_list_the_adapter_kinds_they_apply():
    """A fine-tuning user reads here which servers can carry their bottleneck or deep prompt."""
    trains = record("a", 0, 2)
    trains.adapter_kinds = ["deep_prompt", "bottleneck"]
    health = build_health_map([trains, record("b", 2, 4)], "m", 4)
    lines = render_text(health).splitlines()
    assert "ADAPTERS" in lines[2]
    assert "deep_prompt,bottleneck" in lines[3] and "deep_prompt" not in lines[4]
    assert [server["adapter_kinds"] for server in health.to_json()["servers"]] == [["deep_prompt", "bottleneck"], []]


def test_counts_read_as_english():
    """"1 servers announced" was printed for a swarm of one server (issue 37)."""
    one = render_text(build_health_map([record("a", 0, 1)], "m", 1)).splitlines()
    assert one[0] == "Model 'm': 1 block, 1 server announced"
    assert one[-1] == "OK: every block is served by at least one online server (min 1 replica)."
    two = render_text(build_health_map([record("a", 0, 2), record("b", 0, 2)], "m", 2)).splitlines()
    assert two[0] == "Model 'm': 2 blocks, 2 servers announced" and two[-1].endswith("(min 2 replicas).")
    assert [plural(n, "batch", "batches") for n in (0, 1, 2)] == ["0 batches", "1 batch", "2 batches"]


def test_no_servers_is_not_served():
    health = build_health_map([], "m", 3)
    assert health.uncovered == [(0, 3)] and not health.fully_served
    assert "No server has announced" in render_text(health)


def test_a_peer_id_that_is_none_is_refused_before_joining():
    # Issue 56: it was dialled (exit 3, "could not join the swarm", 11 s); a dead peer with a real id is exit 3
    # (tests/test_cli.py)
    result = run_health("--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/not-a-peer-id", "--dht-prefix", "m",
                        "--num-blocks", "2")
    assert result.exit_code == EXIT_USAGE
    assert "'not-a-peer-id' in '/ip4/127.0.0.1/tcp/1/p2p/not-a-peer-id' is not a peer id" in result.output


# ----- the live local swarm --------------------------------------------------------------------------------
def test_health_map_lists_every_server_of_the_live_swarm(local_swarm, tiny_model_path):
    expected = {p.peer_id: p.span for p in local_swarm.processes if p.alive and p.span}
    result = run_health(*peers_args(local_swarm), "--model", str(tiny_model_path), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["prefix"] == default_prefix(tiny_model_path) and data["num_blocks"] == 4
    assert data["fully_served"] and data["uncovered"] == []
    listed = {s["peer_id"]: s for s in data["servers"]}
    assert set(expected) <= set(listed)
    for peer_id, (start, end) in expected.items():
        server = listed[peer_id]
        assert (server["start"], server["end"], server["state"]) == (start, end, "online")
        assert server["version"] == swarm.__version__ and server["throughput"] > 0
        assert server["cache_tokens_left"] > 0  # its activation cache's free room (512 MB by default), announced
        assert server["unreachable_since"] is None  # alive: it answered the map's probe
    # Per block, the online servers it lists that answered its probe: at least the fixture's 0:2, 2:4 and the replica
    # 1:4. Earlier files on this worker may have left more servers of this model announced, alive or SIGKILLed and
    # not yet expired: a dead one is listed online (its record says so) with when it stopped answering, not counted.
    online = [s for s in data["servers"] if s["state"] == "online" and s["unreachable_since"] is None]
    assert data["replicas"] == [sum(s["start"] <= block < s["end"] for s in online) for block in range(4)]
    assert all(count >= least for count, least in zip(data["replicas"], [1, 2, 2, 2]))


def test_partly_served_model_is_flagged_and_exits_nonzero(local_swarm, tmp_path):
    """A 6-block model whose only server holds 0:3: the map names 3:6; once it stops, 0:6."""
    path = make_checkpoint(tmp_path / "partly_served", tiny_config(num_layers=6), seed=5)
    server = local_swarm.start_server(str(path), "0:3", "--compute-threads", "1")
    try:
        result = run_health(*peers_args(local_swarm), "--model", str(path))
        assert result.exit_code == EXIT_NOT_SERVED, result.output
        assert server.peer_id in result.stdout
        assert "NOT FULLY SERVED: no online server holds blocks 3:6" in result.stdout
    finally:
        assert local_swarm.terminate(server) == 0
    # Without the checkpoint: prefix and block count given directly; the stopped server shows as offline.
    result = run_health(*peers_args(local_swarm), "--dht-prefix", default_prefix(path), "--num-blocks", "6", "--json")
    assert result.exit_code == EXIT_NOT_SERVED
    data = json.loads(result.stdout)
    assert data["uncovered"] == [[0, 6]]
    assert [(s["peer_id"], s["state"]) for s in data["servers"]] == [(server.peer_id, "offline")]
