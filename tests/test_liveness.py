"""One view of liveness (issue 56, item 4): seconds after a server dies, the health map and the client agree.

`generate` failed with "no online server holds blocks 8:16" six seconds after a server was killed, while
`swarm.health` still listed it online and said "OK: every block is served" for 30-40 s more (its record outlives it);
spot checks kept dialling a dead replica that was not on the route, once each time its ban ran out.
"""
from __future__ import annotations

import logging
import signal
import time

import pytest

from swarm.client import DistributedDiffusionLM
from swarm.client.routing import MissingBlocksError
from swarm.dht.schema import default_prefix
from swarm.health.map import read_health_map
from swarm.health.render import render_text
from tests.conftest import make_checkpoint, start_all, stop_all, tiny_config

SHORT = dict(gen_length=8, steps=8, block_length=8, seed=0)


@pytest.fixture
def doomed_swarm(local_swarm, tmp_path):
    """Two servers of every block of a model of its own (its own DHT prefix, on the shared swarm: the shared servers
    hold none of its blocks, so the last holder's death uncovers them): the one a client routes through, and a
    replica that may check its hops."""
    path = make_checkpoint(tmp_path / "liveness-doomed", tiny_config())
    servers = start_all(local_swarm, path, [("0:4", ()), ("0:4", ())])
    yield local_swarm, servers, path
    stop_all(local_swarm, servers)  # a failed test's survivors


def test_the_map_and_the_client_agree_seconds_after_a_server_dies(doomed_swarm, caplog):
    swarm, (whole, replica), tiny_model_path = doomed_swarm
    prefix = default_prefix(tiny_model_path)
    # Spot checks on every hop, bans that run out between generations, and no route refresh meanwhile (the issue's
    # case: bans of 15 s ran out long before the 30 s refresh pinged the dead replica again)
    with DistributedDiffusionLM.from_pretrained(tiny_model_path, initial_peers=swarm.initial_peers,
                                                spot_check_fraction=1.0, ban_base=0.5, route_refresh=600.0,
                                                max_retries=3, retry_deadline=15) as lm:
        lm.generate("Hi", **SHORT)
        assert read_health_map(lm.dht, prefix, 4, probe_with=lm.caller).unreachable == {}, "both answer while alive"
        swarm.signal(replica, signal.SIGKILL)
        replica.process.wait(timeout=30)
        health = read_health_map(lm.dht, prefix, 4, probe_with=lm.caller)
        assert replica.peer_id in health.unreachable and whole.peer_id not in health.unreachable
        assert health.replicas == [1, 1, 1, 1], "the dead replica no longer counts"
        assert "unreachable since" in render_text(health)
        caplog.set_level(logging.WARNING, logger="swarm.client.peers")
        caplog.clear()
        for _ in range(4):  # its bans (0.5, 1, 2 s) run out in between: not asked again, since it answered no ping
            result = lm.generate("Hi", **SHORT)
            assert all(check["verdict"] != "unresolved" for check in result.info["spot_checks"])
            time.sleep(2.5)
        dialled = [record.getMessage() for record in caplog.records
                   if replica.peer_id in record.getMessage() and "spot check" in record.getMessage()]
        assert len(dialled) <= 1, f"spot checks dialled the dead replica {len(dialled)} times: {dialled}"
        # The last holder of every block dies: the client's error and the map name the same blocks
        swarm.signal(whole, signal.SIGKILL)
        whole.process.wait(timeout=30)
        with pytest.raises(MissingBlocksError, match="no online server holds blocks 0:"):
            lm.generate("Hi", **SHORT)
        health = read_health_map(lm.dht, prefix, 4, probe_with=lm.caller)
        assert health.uncovered == [(0, 4)] and set(health.unreachable) <= {whole.peer_id, replica.peer_id}
        assert "NOT FULLY SERVED: no online server holds blocks 0:4" in render_text(health)

