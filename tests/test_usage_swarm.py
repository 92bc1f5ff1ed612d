"""Use management on a live server (issue 39 item 4, issue 48 item 5): two clients (two libp2p ids) on one server
started with ``--max-share-per-caller 0.5``. The red team's attack: a stranger's tiny call makes the heavy user "over
its share"; the old cap then refused the heavy user while the server sat idle (one generation took 179.5 s instead of
0.04 s). Now the share only orders callers that wait, so the heavy user is never refused, and ``rpc_info`` counts
both. Each client stamps its first call with proof of work (issue 55 class 6), which the server credits once. The
ledger, the scheduler and the stamps are unit-tested in tests/test_usage.py, tests/test_scheduler.py and
tests/test_work_stamps.py."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from swarm.dht.schema import default_prefix
from swarm.frontend.local import DiffusionLM
from swarm.health.map import read_health_map
from swarm.health.render import render_text
from swarm.wire.messages import ForwardRequest, RemoteError
from swarm.wire.work import mint
from tests.conftest import make_checkpoint, stop_all, swarm_client, tiny_config
from tests.test_health import peers_args, run_health

FAST = dict(gen_length=16, steps=4, block_length=8, temperature=0.0, seed=0)
ALONE, BESIDE = 10, 5  # the heavy caller's calls alone (then 100% of the server's work: far over a 0.5 share), and
# beside the stranger's


def test_a_strangers_tiny_calls_never_get_a_heavy_user_refused_on_an_idle_server(local_swarm, tmp_path):
    path = make_checkpoint(tmp_path / "usage", tiny_config(), seed=11)
    server = local_swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--max-share-per-caller", "0.5",
                                      "--share-window", "120")
    heavy, light = swarm_client(local_swarm, path), swarm_client(local_swarm, path)
    try:
        heavy_id, light_id = str(heavy.dht.peer_id), str(light.dht.peer_id)
        assert heavy_id != light_id
        heavy.show_route()  # connected (and challenged: a first, small use of the server)

        def call(lm, batch: int, length: int) -> torch.Tensor:
            hidden = torch.randn(batch, length, lm.config.hidden_size)
            return lm.loop.run(lm.caller.forward(server.peer_id, ForwardRequest(0, 4, hidden, "", -1), 30))

        for _ in range(ALONE):  # the heavy caller works alone at first
            call(heavy, 16, 256)
        light.show_route()  # the stranger comes: challenged (a small pass) and served
        light_output = call(light, 1, 8)
        assert light_output.shape == (1, 8, light.config.hidden_size)
        for _ in range(BESIDE):  # the heavy caller is now far over its share, and the server idle between its calls:
            assert call(heavy, 16, 256).shape == (16, 256, heavy.config.hidden_size)  # served, never refused
            assert call(light, 1, 8).shape == (1, 8, light.config.hidden_size)  # the stranger's calls go on too
        result = light.generate("light", **FAST)
        assert result.token_ids == DiffusionLM.from_pretrained(path).generate("light", **FAST).token_ids

        info, _ = light.loop.run(light.caller.info(server.peer_id, 10))
        usage = info["usage"]
        callers = {entry["peer_id"]: entry for entry in usage["callers"]}
        assert set(callers) == {heavy_id, light_id}
        assert usage["max_share"] == 0.5 and usage["window_s"] == 120
        assert callers[heavy_id]["tokens"] >= (ALONE + BESIDE) * 16 * 256 * 4 and callers[heavy_id]["refused"] == 0
        assert 0 < callers[light_id]["tokens"] < callers[heavy_id]["tokens"] and callers[light_id]["refused"] == 0
        assert callers[heavy_id]["seconds"] > callers[light_id]["seconds"] > 0
        assert usage["total"]["tokens"] == sum(entry["tokens"] for entry in usage["callers"])
        assert usage["refused"] == 0
        # issue 55 class 6: each default client stamped its first call with proof of work, which the server credited
        # (the caller and server ids it checks are the ones the client minted for), and no more unless the server
        # answered that a call had waited for another's (on a loaded machine the light call can wait for a heavy one:
        # then it stamps while told so); a stamp sent twice is credited once, a malformed one refused
        stamps = info["work_stamps"]
        assert stamps["credited"] >= 2 and stamps["refused"] == {}, stamps
        for stamper in (heavy.caller.stamper, light.caller.stamper):
            assert stamper.minted == 1 or stamper.contended > 0, (stamper.minted, stamper.contended)
        hidden = torch.randn(1, 8, light.config.hidden_size)
        stamped = ForwardRequest(0, 4, hidden, "", -1, work=mint(server.peer_id, light_id, 12))
        light.caller.stamper = None  # sent as it is
        for _ in range(2):
            light.loop.run(light.caller.forward(server.peer_id, stamped, 30))
        bad = dataclasses.replace(stamped, work=dataclasses.replace(stamped.work, salt="not hex"))
        with pytest.raises(RemoteError, match="'work' salt"):
            light.loop.run(light.caller.forward(server.peer_id, bad, 30))
        stamps = light.loop.run(light.caller.info(server.peer_id, 10))[0]["work_stamps"]
        assert stamps["refused"] == {"spent": 1}, stamps
        # swarm.health --usage shows the same counts, in JSON (the command, in this process: a process of its own
        # imported torch and hivemind first, ~2.3 CPU s more) and as text (its renderer, on the map the command reads:
        # a second run of the command is a second DHT peer and daemon)
        done = run_health("--model", str(path), "--usage", *peers_args(local_swarm), "--json")
        assert done.exit_code == 0, done.output[-2000:]
        shown = {entry["peer_id"]: entry["usage"] for entry in json.loads(done.stdout)["servers"]}[server.peer_id]
        assert {entry["peer_id"] for entry in shown["callers"]} == {heavy_id, light_id}
        assert shown["total"]["tokens"] >= usage["total"]["tokens"] and shown["refused"] == 0
        assert shown["max_share"] == 0.5
        text = render_text(read_health_map(light.dht, default_prefix(path), 4, probe_with=light.caller, usage=True))
        assert "SHARE CAP" in text and f"...{heavy_id[-8:]}" in text and "50% of 120 s" in text
        print(text)
        print(f"\nusage: {usage}")
    finally:
        heavy.shutdown()
        light.shutdown()
        stop_all(local_swarm, [server])  # its own prefix

