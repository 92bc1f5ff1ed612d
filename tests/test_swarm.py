"""The swarm end to end, with real subprocess servers on 127.0.0.1 and the real hivemind DHT."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from swarm.client import DistributedDiffusionLM, MissingBlocksError
from swarm.dht.node import NetworkConfig, start_dht
from swarm.dht.schema import ServerRecord, ServerState, block_key, default_prefix, read_servers
from swarm.dht.validation import owner_peer_id
from swarm.utils.local_swarm import signal_family
from swarm.wire.messages import ErrorCode, ForwardRequest, RemoteError
from tests.conftest import make_checkpoint, stop_all, tiny_config, wait_until

CASES = [
    ("Hello there", dict(seed=0)),
    ("The cat", dict(seed=1, remasking="random", temperature=1.0)),
    ("x", dict(seed=2, remasking="margin", temperature=0.5, cfg_scale=1.0)),
    ("abc def", dict(seed=3, remasking="entropy", threshold=0.2)),
]


@pytest.mark.parametrize("prompt, settings", CASES)
def test_distributed_generation_equals_local(remote_lm, local_lm, prompt, settings):
    kwargs = dict(gen_length=16, steps=8, block_length=8, **settings)
    remote = remote_lm.generate(prompt, **kwargs)
    local = local_lm.generate(prompt, **kwargs)
    assert remote.token_ids == local.token_ids
    assert torch.equal(remote.sequence, local.sequence)


def test_distributed_logits_match_local_closely(remote_lm, local_lm):
    ids = torch.randint(0, 256, (2, 13))
    torch.testing.assert_close(remote_lm.logits(ids), local_lm.logits(ids), rtol=1e-4, atol=1e-4)


def test_route_covers_every_block_in_order(remote_lm):
    route = remote_lm.show_route()
    assert route[0].start == 0 and route[-1].end == remote_lm.config.num_layers
    for previous, hop in zip(route, route[1:]):
        assert previous.end == hop.start
    assert remote_lm.generate("hi", gen_length=8, steps=8, block_length=8).info["route"]


def test_stream_through_swarm_ends_with_result(remote_lm):
    chunks = list(remote_lm.generate_stream("hi", gen_length=8, steps=4, block_length=8))
    assert [c.step for c in chunks[:-1]] == [0, 1, 2, 3]
    assert chunks[-1].done and chunks[-1].result is not None
    assert chunks[-2].text.count("_") == 0 and chunks[0].text.count("_") == 6


def test_unserved_blocks_fail_fast_and_are_named(local_swarm, tmp_path, swarm_peer):
    """A model with 6 blocks of which a server holds only 0:3: the error names 3:6."""
    path = make_checkpoint(tmp_path / "half_served", tiny_config(num_layers=6), seed=3)
    server = local_swarm.start_server(str(path), "0:3", "--compute-threads", "1")
    lm = DistributedDiffusionLM.from_pretrained(path, dht=swarm_peer)
    try:
        started = time.monotonic()
        with pytest.raises(MissingBlocksError, match="3:6") as missing:
            lm.generate("hello", gen_length=8, steps=8, block_length=8)
        print(f"missing blocks reported after {time.monotonic() - started:.2f} s")
        # Fast by construction: refused while building the route, before any call or retry (nothing tried).
        assert missing.value.blocks == [3, 4, 5] and "tried" not in str(missing.value)
        assert lm.sequence.failovers == []
        # A stopped server leaves the swarm announcing itself offline.
        assert local_swarm.terminate(server) == 0
        records = read_servers(lm.dht, default_prefix(path), 6)
        assert records[server.peer_id].state == ServerState.OFFLINE
    finally:
        lm.shutdown()


def test_signed_record_cannot_be_overwritten_by_another_peer(local_swarm, remote_lm, tiny_model_path):
    prefix = default_prefix(tiny_model_path)
    victim = next(p for p in local_swarm.processes if p.alive and p.span == (0, 2))
    key = block_key(prefix, 0)
    entry = remote_lm.dht.get(key, latest=True)
    # The victim's signed subkey. Not merely one that starts with its peer id: test_security_records leaves plain
    # subkeys such as b"<victim id>" behind (peers keep plain subkeys, readers ignore them), and storing under
    # one of those succeeds without touching the victim's record.
    subkey = next(s for s in entry.value if owner_peer_id(s) == victim.peer_id)
    intruder = start_dht(NetworkConfig(initial_peers=local_swarm.initial_peers))
    try:
        forged = ServerRecord(victim.peer_id, ServerState.OFFLINE, 0, 2, 1.0).to_value()
        stored = intruder.store(key, forged, expiration_time=time.time() + 600, subkey=subkey)
        assert not stored
        record = read_servers(remote_lm.dht, prefix, 4)[victim.peer_id]
        assert record.state == ServerState.ONLINE
    finally:
        intruder.shutdown()


def test_int8_server_serves_close_logits(local_swarm, tiny_model_path, local_lm, tmp_path, swarm_peer):
    """--quant int8: smaller weights, logits close to the exact ones (not identical); an approximate server,
    avoided unless the client allows approximate servers."""
    path = make_checkpoint(tmp_path / "quantized", tiny_config(), seed=0)
    server = local_swarm.start_server(str(path), "0:4", "--quant", "int8", "--compute-threads", "1")
    strict = DistributedDiffusionLM.from_pretrained(path, dht=swarm_peer)
    try:
        with pytest.raises(MissingBlocksError):
            strict.show_route()
    finally:
        strict.shutdown()
    lm = DistributedDiffusionLM.from_pretrained(path, dht=swarm_peer, allow_approximate=True)
    try:
        ids = torch.randint(0, 256, (1, 12))
        exact = local_lm.logits(ids)
        quantized = lm.logits(ids)
        assert not torch.equal(quantized, exact)
        relative = (quantized - exact).norm() / exact.norm()
        assert relative < 0.1, relative
    finally:
        lm.shutdown()
        stop_all(local_swarm, [server])  # its own prefix


@pytest.mark.parametrize("window, remasking", [(4, "random"), (3, "low_confidence"), (8, "entropy")])
def test_picard_windows_through_swarm_equal_sequential_local(remote_lm, local_lm, window, remasking):
    kwargs = dict(gen_length=16, steps=16, block_length=8, remasking=remasking, temperature=0.5, seed=11)
    sequential = local_lm.generate("picard", **kwargs)
    parallel = remote_lm.generate("picard", parallel_window=window, **kwargs)
    assert parallel.token_ids == sequential.token_ids
    assert parallel.steps == sequential.steps == 16
    assert parallel.denoiser_calls <= sequential.denoiser_calls
    assert sum(w.accepted for w in parallel.windows) == 16
    assert parallel.states_evaluated == window * parallel.denoiser_calls


def test_scale_local_auto_and_max(remote_lm, local_lm):
    kwargs = dict(gen_length=16, steps=16, block_length=8, seed=4, remasking="random")
    expected = local_lm.generate("scale", **kwargs)
    local = remote_lm.generate("scale", scale="local", **kwargs)
    assert local.info["scale"] == "local" and local.info["route"] == ["local"]
    auto = remote_lm.generate("scale", **kwargs)
    assert auto.info["scale"] == "auto" and auto.denoiser_calls < auto.steps, "auto uses Picard windows"
    maximal = remote_lm.generate("scale", scale="max", experts={}, **kwargs)
    assert maximal.info["scale"] == "max"
    assert_every_hop_rerun_on_a_replica(remote_lm, maximal)
    for result in (local, auto, maximal):
        assert result.token_ids == expected.token_ids
    with pytest.raises(ValueError, match="unknown scale"):
        remote_lm.generate("scale", scale="huge", **kwargs)


def assert_every_hop_rerun_on_a_replica(lm, result) -> None:
    """``scale="max"`` re-runs each hop on another server holding its blocks: every hop agreed with its checker, a
    hop with a replica was re-run on one, and a hop without one (here 0:2: the replica 1:4 lacks block 0) is
    recomputed by the client on its own checkpoint, which holds every block (issue 48; before, it said
    ``no_checker``). The replicas are read after the run: a server another test of this worker started may have been
    seen only after its hop was checked (a check then recomputed locally, seen in a loaded full run), so a local
    check passes where a replica is known now; the fixture's 1:4 replica of 2:4 is known all along, so one hop at least
    is re-run on a replica."""
    checks = result.info["spot_checks"]
    assert len(checks) == result.denoiser_calls * len(result.info["route"])
    for check in checks:
        start, end = check["blocks"]
        replicas = set(lm.planner.holders(start, end, frozenset({check["primary"]})))
        assert set(check["checkers"]) <= replicas | {"local"}, check
        assert check["verdict"] == "agreed", (check, replicas)
    assert any(set(check["checkers"]) - {"local"} for check in checks), "no hop was re-run on a replica"


def test_scale_local_needs_every_block_locally(local_swarm, tmp_path, swarm_peer):
    """A client whose checkpoint holds only the embeddings and head cannot run locally."""
    from swarm.models.checkpoint import CheckpointReader, save_checkpoint
    from swarm.models.loading import ModelFiles

    full = make_checkpoint(tmp_path / "full", tiny_config(), seed=0)
    reader = CheckpointReader(full)
    names = [n for n in reader.weight_map if not n.startswith("blocks.")]
    save_checkpoint(tmp_path / "client_only", ModelFiles(full).config, reader.read(names))
    with DistributedDiffusionLM.from_pretrained(tmp_path / "client_only", dht=swarm_peer, dht_prefix="tiny") as lm:
        with pytest.raises(ValueError, match="lacks blocks 0:4"):
            lm.generate("x", scale="local", gen_length=8, steps=8, block_length=8)


def living(processes: list[psutil.Process]) -> list[int]:
    """The pids of ``processes`` still running (a zombie has stopped: only its exit is unread)."""
    alive = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process.pid)
    return alive


def test_bootstrap_peer_stops_on_sigterm_after_its_parent_is_gone():
    """With its parent gone nobody reads its output: stopping must not depend on writing there. It exits with
    0 and stops its DHT process and libp2p daemon itself (the daemon is not even in its process group)."""
    command = [sys.executable, "-m", "swarm.dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    family: list[psutil.Process] = []
    try:
        for line in process.stdout:
            if "DHT READY" in line:
                break
        family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        assert len(living(family)) >= 3, "the peer, its DHT process and its daemon"
        process.stdout.close()  # as when the parent is killed: writes to the pipe now fail
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert wait_until(lambda: not living(family), timeout=10), \
            f"left running after the peer exited: {living(family)}"
    finally:  # only after a failure above: nothing may outlive the test
        signal_family(process.pid, family, signal.SIGKILL)
        process.wait()


def test_an_answer_whose_stream_lost_its_parts_is_asked_for_once_more(remote_lm):
    """hivemind streams on loopback can rarely lose messages: one such answer is not the server's failure."""
    hop = remote_lm.show_route()[0]
    request = ForwardRequest(hop.start, hop.end, torch.randn(1, 4, remote_lm.config.hidden_size), "", -1)
    send = remote_lm.caller._forward_rpc(hop.peer_id, request)
    sent = []

    async def first_answer_lost() -> list:
        sent.append(1)
        return [] if len(sent) == 1 else await send()

    hidden, _ = remote_lm.loop.run(remote_lm.caller._call(hop.peer_id, first_answer_lost, 10))
    assert len(sent) == 2 and hidden.shape == (1, 4, remote_lm.config.hidden_size)

    async def always_lost() -> list:
        return []

    with pytest.raises(RemoteError) as lost:
        remote_lm.loop.run(remote_lm.caller._call(hop.peer_id, always_lost, 10))
    assert lost.value.code == ErrorCode.INCOMPLETE
