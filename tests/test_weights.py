"""Weights from the swarm (issue 35, items 3-4): a server started with ``--model ID`` and an empty cache gets its
blocks from peers and computes what the local model does; published names; and hostile peers.

Everything is real: a bootstrap peer and a server of the tiny checkpoint as subprocesses (the server serves its
weights, as every server does by default), libp2p daemons on 127.0.0.1, safetensors files on disk. The hostile
peer is the real :class:`WeightServer` on a DHT peer of this process, changing what it sends.

Each DHT peer is a process and a libp2p daemon (about 1 CPU s): this process's fetches, resolutions
(``SwarmWeights(dht=...)``), publishes and reads share one client peer, ``client``; a command keeps its own where
the command is the point, and so does a peer whose identity is (the liars, a reader capped per peer).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from functools import partial
from pathlib import Path
from typing import AsyncIterator

import pytest
from click.testing import CliRunner
from hivemind.dht.routing import DHTID
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from huggingface_hub import constants
from safetensors.torch import load_file, save_file

from swarm.dht.identity import Identity
from swarm.dht.node import NetworkConfig, start_dht, stop_dht
from swarm.dht.schema import now, read_servers
from swarm.dht.validation import sign_slot, slot_subkey
from swarm.governance.keys import generate_private_key, load_private_key, public_key_text
from swarm.models.loading import ModelFiles
from swarm.utils.event_loop import BackgroundLoop
from swarm.utils.local_swarm import LocalSwarm
from swarm.weights.__main__ import main as weights_main
from swarm.weights.cache import ModelCache, tensor_file
from swarm.weights.fetch import FetchConfig, Fetcher, PeerBook
from swarm.weights.holdings import Holdings
from swarm.weights.manifest import build_manifest, sha256_hex
from swarm.weights.records import (
    HostRecord,
    PublishedModel,
    WeightsError,
    declare_host,
    hosts_key,
    name_key,
    publish,
    read_hosts,
    read_published,
)
from swarm.weights.service import Bandwidth, ServeLimits, WeightServer
from swarm.weights.source import SwarmWeights
from swarm.weights.trust import PublisherTrust
from swarm.weights.wire import MANIFEST, TENSOR, ReadRequest, data_messages, read_range
from swarm.wire.messages import ErrorCode, RemoteError
from tests.conftest import make_checkpoint, stop_all, tiny_config, wait_until
from tests.test_hub import full_disk  # noqa: F401 (fixture)
from tests.test_security_dht import flood, plain_attacker

ROOT = Path(__file__).resolve().parent.parent
GENERATION = dict(gen_length=16, steps=16, block_length=8)
DHT_POLL = 1.0  # seconds between DHT reads while waiting for a record (each read is traffic on every peer it asks)


def addresses_of(maddrs: list[str]) -> list[str]:
    return [str(a).rsplit("/p2p/", 1)[0] for a in maddrs]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """HF_HOME of every process here: its swarm/weights/{id} cache starts empty."""
    return tmp_path_factory.mktemp("hf-home")


@pytest.fixture(scope="module")
def swarm(tiny_model_path, home, local_swarm):
    """A bootstrap peer and a server of blocks 0:2 of the tiny checkpoint (it serves every tensor of it). A DHT of
    its own: the session swarm's servers serve the same checkpoint, so they would be hosts of this model too. Its
    processes fork from the session swarm's fork server (one of its own costs 1.5 CPU s): each gets this swarm's
    HF_HOME, read when the weights' modules are first imported, after the fork."""
    with LocalSwarm(env={"HF_HOME": str(home), "PYTHONPATH": str(ROOT)}, shared_forks=local_swarm.forks) as swarm:
        swarm.start_bootstrap()
        swarm.start_server(str(tiny_model_path), "0:2", "--compute-threads", "1", name="publisher")
        yield swarm
        stop_all(swarm, swarm.processes)  # a swarm of its own, read by nobody after: no graceful leave to wait for


@pytest.fixture(scope="module")
def model_id(tiny_model_path) -> str:
    return build_manifest(tiny_model_path).model_id


@pytest.fixture(scope="module")
def peer(swarm):
    """A DHT peer of this process with a libp2p identity, for in-process hosts and readers."""
    identity = Identity.load_or_create()
    dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), identity=identity)
    yield dht, identity
    stop_dht(dht)
    identity.remove()


@pytest.fixture(scope="module")
def liars(swarm, tiny_model_path):
    """Issue 48's attack on fetch by id: keyless peers store their own hosts records under the model's key with
    lying hints: two claim the manifest is a byte shorter (the size most records then give), one that it is a
    byte longer and that it holds every tensor. None serves anything: each leaves once its record is stored, as a
    stranger with a free identity may (the record stays on the peers that stored it until it expires), so the
    module's other traffic passes through three DHT peers fewer."""
    manifest = build_manifest(tiny_model_path)
    size = len(manifest.to_bytes())
    liars = []
    for claim in (size - 1, size - 1, size + 1):
        identity = Identity.load_or_create()
        dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), identity=identity)
        try:
            record = HostRecord(str(dht.peer_id), (), claim)
            assert declare_host(dht, manifest.model_id, record, identity.owner_subkey(), now() + 3000)
            liars.append(str(dht.peer_id))
        finally:
            stop_dht(dht)
            identity.remove()
    return liars


@pytest.fixture(scope="module")
def client(swarm):
    """A client DHT peer of this process that its fetches, resolutions, publishes and reads share (it hosts
    nothing: a peer cannot dial itself, so it must not be ``peer``, the hostile server's)."""
    dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers, client_mode=True))
    yield dht
    stop_dht(dht)


def weights_of(client, swarm, **options) -> SwarmWeights:
    """A resolver on the swarm through ``client`` (no DHT peer of its own)."""
    return SwarmWeights(NetworkConfig(initial_peers=swarm.initial_peers), dht=client, **options)


@pytest.fixture()
def cache_home(home, tmp_path, monkeypatch) -> Path:
    """This process's HF_HOME for the test: a fresh cache."""
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def blocks_of(names: list[str], *blocks: int) -> frozenset[int]:
    return frozenset(i for i, n in enumerate(names) if n.startswith(tuple(f"blocks.{b}." for b in blocks)))


def test_a_server_named_by_id_starts_from_peers_alone_and_computes_as_the_local_model(
        swarm, peer, client, liars, model_id, home, tiny_model_path, local_lm, cache_home):
    """With the liars' records there too (issue 48): their size hints ban nobody."""
    dht, _ = peer
    publisher = next(p for p in swarm.processes if p.name == "publisher")
    assert wait_until(lambda: publisher.peer_id in {h.peer_id for h in read_hosts(dht, model_id)}, timeout=60,
                      interval=DHT_POLL), "the publisher announces its weights"
    assert set(liars) <= {h.peer_id for h in read_hosts(dht, model_id)}
    cache = home / "swarm" / "weights" / model_id
    # the servers' cache, which another test's server by id or by name may have filled (any order; each stops its
    # server): this one starts from peers alone
    shutil.rmtree(cache, ignore_errors=True)
    server = swarm.start_server(model_id, "2:4", "--compute-threads", "1", name="by-id")
    installed = json.loads((cache / "manifest.json").read_bytes())
    names = [t["name"] for t in installed["tensors"]]
    fetched = {p.name for p in (cache / installed["name"]).glob("t-*.safetensors")}
    assert fetched == {tensor_file(i) for i in blocks_of(names, 2, 3)}, "only blocks 2 and 3 were fetched"
    assert installed["name"] == tiny_model_path.name  # so it announces under the publisher's DHT prefix
    assert any("fetched" in line and "from 1 peers" in line for line in server.log), server.log[-20:]
    assert not any("banning peer" in line and publisher.peer_id in line for line in server.log)

    from swarm.client import DistributedDiffusionLM

    # the client names the model by id too: its config and embedding come from peers (this process's cache)
    # Spot checks off: a default client recomputes an unchecked hop on blocks it fetches itself (docs/GOVERNANCE.md),
    # and this test is about what a client fetches to run, not to check.
    # (through this process's client peer: dht= resolves the id there too)
    lm = DistributedDiffusionLM.from_pretrained(model_id, initial_peers=swarm.initial_peers, request_timeout=20,
                                                spot_check_fraction=0, dht=client)
    try:  # blocks 2:4 are served by the new server alone
        assert lm.generate("Hello", **GENERATION).token_ids == local_lm.generate("Hello", **GENERATION).token_ids
    finally:
        lm.shutdown()
    # and so does the command line: `python -m swarm.generate PROMPT --model ID --initial-peers ...`
    from swarm.generate import main as generate

    flags = [f"--{name.replace('_', '-')}={value}" for name, value in GENERATION.items()]
    done = CliRunner().invoke(generate, ["Hello", "--model", model_id, *flags, "--spot-check-fraction", "0",
                                         *[arg for a in swarm.initial_peers for arg in ("--initial-peers", a)]])
    assert done.exit_code == 0, done.output
    assert done.stdout == "Hello" + local_lm.generate("Hello", **GENERATION).text + "\n"
    client_files = {p.name for p in (cache_home / "swarm" / "weights" / model_id).glob("*/t-*.safetensors")}
    assert tensor_file(names.index("embed.weight")) in client_files
    assert not client_files & {tensor_file(i) for i in blocks_of(names, 0, 1, 2, 3)}, "a client fetches no block"
    # it serves what it fetched: its hosts record lists exactly those tensors
    assert wait_until(lambda: any(h.peer_id == server.peer_id and h.tensors == blocks_of(names, 2, 3)
                                  for h in read_hosts(dht, model_id)), interval=DHT_POLL)
    # it knows the model's hosts key: its storage refuses plain subkeys there, and so does the bootstrap peer, which
    # knows no model but has learnt the key's policy from the hosts records, which name their key (swarm.dht.keys)
    attacker = plain_attacker(swarm.initial_peers)
    try:
        assert flood(attacker, hosts_key(model_id), [server.peer_id, swarm.bootstrap.peer_id], 8) == [False, False]
    finally:
        attacker.shutdown()


# ----- hostile peers -------------------------------------------------------------------------------------------
class HostileWeightServer(WeightServer):
    """The real weight server, changing what it sends as ``mode`` says: ``flip`` one byte of every chunk,
    ``truncate`` (half of the first chunk, then the end), ``oversized`` (a byte more than asked for),
    ``endless`` (empty messages, forever)."""

    mode = "flip"

    async def rpc_read(self, request: runtime_pb2.ExpertRequest,
                       context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        while self.mode == "endless":
            yield data_messages([b""])[0]
        async for message in super().rpc_read(request, context):
            if message.tensors and self.mode == "flip":
                buffer = bytearray(message.tensors[0].buffer)
                buffer[len(buffer) // 2] ^= 0x01
                message.tensors[0].buffer = bytes(buffer)
            elif message.tensors and self.mode == "truncate":
                message.tensors[0].buffer = message.tensors[0].buffer[:len(message.tensors[0].buffer) // 2]
                yield message
                return
            elif message.tensors and self.mode == "oversized":
                message.tensors[0].buffer += b"\0"
            yield message


@pytest.fixture(scope="module")
def hostile(peer, tiny_model_path):
    """The hostile server on this process's peer, holding the tiny model; announced as one of its hosts."""
    dht, identity = peer
    server = HostileWeightServer()
    loop = BackgroundLoop.shared()
    p2p = loop.run(dht.replicate_p2p())
    loop.run(server.add_p2p_handlers(p2p))
    server.holdings = Holdings.of_model(tiny_model_path)
    server.addresses = addresses_of(loop.run(p2p.get_visible_maddrs()))
    server.peer_id = str(dht.peer_id)
    yield server
    loop.run(server.remove_p2p_handlers(p2p))


@pytest.fixture(scope="module")
def fetching(client):
    """The P2P of ``client`` to fetch with (not the hostile server's: a peer cannot dial itself)."""
    return BackgroundLoop.shared().run(client.replicate_p2p())


def hosts(swarm, hostile, manifest_bytes: int, honest: bool = True) -> list[HostRecord]:
    """The hostile host first (the fetcher asks the least busy first, in this order), then the honest one."""
    publisher = next(p for p in swarm.processes if p.name == "publisher")
    records = [HostRecord(hostile.peer_id, tuple(hostile.addresses), manifest_bytes)]
    return records + ([HostRecord(publisher.peer_id, tuple(addresses_of(publisher.maddrs)), manifest_bytes)]
                      if honest else [])


def installed_cache(tiny_model_path: Path, root: Path):
    """The cache of the tiny model with its manifest and config installed (as a resolved id has it)."""
    manifest = build_manifest(tiny_model_path)
    cache = ModelCache(manifest.model_id, root)
    files = {f.name: (tiny_model_path / f.name).read_bytes() for f in manifest.files}
    cache.install(manifest.to_bytes(), manifest, files)
    return manifest, cache


def assert_only_checked_bytes(manifest, cache) -> None:
    """Every tensor file holds exactly its bytes; every partial file holds, part by part, right bytes or zeros."""
    for index, entry in enumerate(manifest.tensors):
        path = cache.tensor_path(manifest, index)
        if path.exists():
            data = path.read_bytes()
            assert sha256_hex(data[-entry.size:] if entry.size else b"") == entry.sha256
    for path in (cache.directory / "partial").glob("*"):
        entry = manifest.tensors[int(path.name[2:7])]
        data = path.read_bytes()[-entry.size:]
        for part, digest in enumerate(entry.parts):
            start, length = entry.part(part)
            chunk = data[start:start + length]
            assert sha256_hex(chunk) == digest or chunk == bytes(length), f"bad bytes kept in {path.name}"


@pytest.mark.parametrize("mode, reason", [("flip", "hash differs"), ("truncate", "ended after"),
                                          ("oversized", "more than the"), ("endless", "an endless stream")])
def test_a_hostile_peer_is_banned_and_its_parts_come_from_another(
        swarm, hostile, fetching, tiny_model_path, tmp_path, mode, reason):
    hostile.mode = mode
    manifest, cache = installed_cache(tiny_model_path, tmp_path)
    wanted = sorted(blocks_of([t.name for t in manifest.tensors], 1))
    loop = BackgroundLoop.shared()

    alone = Fetcher(fetching, manifest.model_id, PeerBook(hosts(swarm, hostile, len(manifest.to_bytes()), False),
                                                          FetchConfig()))
    with pytest.raises(WeightsError, match=f"no peer delivered .*{reason}"):
        loop.run(alone.fetch_tensors(manifest, cache, wanted), timeout=60)
    assert hostile.peer_id in alone.book.banned
    assert not any(cache.tensor_path(manifest, i).exists() for i in wanted)
    assert_only_checked_bytes(manifest, cache)

    book = PeerBook(hosts(swarm, hostile, len(manifest.to_bytes())), FetchConfig())
    fetcher = Fetcher(fetching, manifest.model_id, book)
    loop.run(fetcher.connect())
    report = loop.run(fetcher.fetch_tensors(manifest, cache, wanted), timeout=60)
    assert hostile.peer_id in book.banned and reason in book.banned[hostile.peer_id]
    assert set(report.bytes_by_peer) == {next(p.peer_id for p in swarm.processes if p.name == "publisher")}
    assert all(cache.tensor_path(manifest, i).exists() for i in wanted)
    assert_only_checked_bytes(manifest, cache)


def test_a_fetch_resumes_with_the_parts_checked_before_and_only_those(
        swarm, hostile, fetching, tiny_model_path, tmp_path):
    manifest, cache = installed_cache(tiny_model_path, tmp_path)
    index = next(i for i, t in enumerate(manifest.tensors) if len(t.parts) == 4)
    entry = manifest.tensors[index]
    original = (tiny_model_path / entry.file).read_bytes()[entry.offset:entry.offset + entry.size]
    partial = cache.partial(manifest, index)  # a crashed fetch: parts 0 and 1 checked and written,
    for part in (0, 1):
        start, length = entry.part(part)
        partial.write(part, original[start:start + length])
    start, length = entry.part(2)  # ... part 2 half written when it died
    os.pwrite(partial.fd, b"\xff" * (length // 2), len(partial.header) + start)
    partial.close()

    book = PeerBook(hosts(swarm, hostile, len(manifest.to_bytes()))[1:], FetchConfig())
    fetcher = Fetcher(fetching, manifest.model_id, book)
    loop = BackgroundLoop.shared()
    loop.run(fetcher.connect())
    report = loop.run(fetcher.fetch_tensors(manifest, cache, [index]), timeout=60)
    assert report.parts_resumed == 2 and report.parts == 2
    assert report.nbytes == sum(entry.part(p)[1] for p in (2, 3))
    assert cache.tensor_path(manifest, index).read_bytes()[-entry.size:] == original


def test_a_manifest_whose_shapes_disagree_with_its_config_is_refused_and_nothing_stays(
        hostile, peer, client, swarm, tiny_model_path, tmp_path, cache_home):
    dht, identity = peer
    lying = tmp_path / tiny_model_path.name
    shutil.copytree(tiny_model_path, lying)
    config = json.loads((lying / "config.json").read_text())
    (lying / "config.json").write_text(json.dumps(dict(config, intermediate_size=48)))
    saved = hostile.holdings
    try:
        hostile.mode = None
        hostile.holdings = Holdings.of_model(lying)
        model_id = hostile.holdings.model_id
        record = hostile.holdings.host_record(hostile.peer_id, hostile.addresses)
        assert declare_host(dht, model_id, record, identity.owner_subkey(), now() + 60)
        weights = weights_of(client, swarm)
        try:
            with pytest.raises(WeightsError, match=r"disagrees with its config: blocks.0.mlp.gate_proj.weight is "
                                                   r"\[64, 32\], its config says \[48, 32\]"):
                weights.resolve(model_id)
        finally:
            weights.close()
        assert not (cache_home / "swarm" / "weights" / model_id).exists()
    finally:
        hostile.holdings = saved


def test_a_manifest_that_does_not_hash_to_its_id_is_refused(hostile, client, fetching, swarm, tiny_model_path,
                                                            cache_home):
    hostile.mode = "flip"
    manifest = build_manifest(tiny_model_path)
    weights = weights_of(client, swarm)
    try:
        source = weights.open(manifest.model_id, len(manifest.to_bytes()))
    finally:
        weights.close()
    # the hostile peer may have been asked first: then it is banned for sending a manifest of other bytes
    assert all("hash differs" in reason for reason in weights.banned.values())
    assert (source.path / "config.json").read_bytes() == (tiny_model_path / "config.json").read_bytes()
    alone = Fetcher(fetching, manifest.model_id, PeerBook(hosts(swarm, hostile, len(manifest.to_bytes()), False),
                                                          FetchConfig()))
    request = ReadRequest(manifest.model_id, MANIFEST, "", 0, len(manifest.to_bytes()))
    with pytest.raises(WeightsError, match="no peer delivered the manifest .*hash differs"):
        BackgroundLoop.shared().run(alone.read_checked(request, manifest.model_id, None, "the manifest"))


# ----- what a server serving weights allows ----------------------------------------------------------------------
@pytest.fixture()
def own_fetching(swarm):
    """A client DHT peer of the test's own: the reads it leaves streaming count against its peer id, not against
    the shared ``client``'s."""
    dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers, client_mode=True))
    yield BackgroundLoop.shared().run(dht.replicate_p2p())
    stop_dht(dht)


def test_reads_are_capped_in_bandwidth_and_per_peer(hostile, own_fetching, tiny_model_path):
    fetching = own_fetching
    manifest = build_manifest(tiny_model_path)
    index, entry = max(enumerate(manifest.tensors), key=lambda item: item[1].size)  # the embedding, 33 KB
    request = ReadRequest(manifest.model_id, TENSOR, index, 0, entry.size)
    loop = BackgroundLoop.shared()
    hostile.mode = None

    def timed_read() -> float:
        started = time.monotonic()
        data = loop.run(read_range(fetching, hostile.peer_id, request, 30))
        assert sha256_hex(data) == entry.sha256
        return time.monotonic() - started

    assert timed_read() < 1.0
    saved = hostile.bandwidth
    hostile.bandwidth = Bandwidth(0.1)  # 12.5 kB/s, one second of it at once: 33 kB take 1.6 s
    try:
        assert timed_read() > 1.2

        async def five_at_once() -> list:
            """Five reads at once: the one refused is answered at once; the four admitted would share the cap for
            10 s more, so they are given up then (this test's fetching peer reads nothing after them)."""
            reads = [asyncio.ensure_future(read_range(fetching, hostile.peer_id, request, 30)) for _ in range(5)]
            await asyncio.wait(reads, return_when=asyncio.FIRST_EXCEPTION)
            for read in reads:
                read.cancel()
            return await asyncio.gather(*reads, return_exceptions=True)

        results = loop.run(five_at_once())
    finally:
        hostile.bandwidth = saved
    refused = [r for r in results if isinstance(r, RemoteError)]
    assert len(refused) == 1 and refused[0].code == ErrorCode.BUSY, results
    assert f"a peer may stream {ServeLimits().per_peer} weight reads at once" in refused[0].message
    assert all(isinstance(r, asyncio.CancelledError) for r in results if r is not refused[0]), results


def test_a_server_started_with_no_serve_weights_serves_none(swarm, peer, model_id, tiny_model_path):
    dht, _ = peer
    server = swarm.start_server(str(tiny_model_path), "0:1", "--compute-threads", "1", "--no-serve-weights",
                                name="no-weights")
    try:
        assert wait_until(lambda: any(r.peer_id == server.peer_id for r in read_servers(dht, tiny_model_path.name,
                                                                                           4).values()),
                          interval=DHT_POLL)
        assert server.peer_id not in {h.peer_id for h in read_hosts(dht, model_id)}
        request = ReadRequest(model_id, MANIFEST, "", 0, 10)
        with pytest.raises(RemoteError, match="unreachable|no_weights"):
            dht_p2p = BackgroundLoop.shared().run(dht.replicate_p2p())
            BackgroundLoop.shared().run(read_range(dht_p2p, server.peer_id, request, 10))
    finally:
        swarm.terminate(server)


# ----- published names -------------------------------------------------------------------------------------------
def publish_through(client, directory: Path, name: str, key: Path) -> dict:
    """What ``python -m swarm.weights publish`` publishes and prints, through ``client`` (where the command is not the
    point: it is in :func:`test_a_publish_succeeds_only_when_other_peers_return_it`; each run has a DHT peer)."""
    return publish(client, load_private_key(key), PublishedModel.of(name, build_manifest(directory))).to_json()


def test_a_name_claimed_by_two_trusted_publishers_needs_the_publisher(swarm, client, tiny_model_path, tmp_path,
                                                                      cache_home):
    first, second = tmp_path / "first.key", tmp_path / "second.key"
    first_key, second_key = generate_private_key(first), generate_private_key(second)
    other = make_checkpoint(tmp_path / tiny_model_path.name, tiny_config(), seed=5)
    published = publish_through(client, tiny_model_path, "tiny-claimed", first)
    rival = publish_through(client, other, "tiny-claimed", second)
    assert published["model_id"] == build_manifest(tiny_model_path).model_id != rival["model_id"]

    peers = [arg for peer in swarm.initial_peers for arg in ("--initial-peers", peer)]
    shown = CliRunner().invoke(weights_main, ["show", "tiny-claimed", "--trusted-publishers",
                                              public_key_text(first_key), *peers])
    assert shown.exit_code == 0, shown.output
    listed = json.loads(shown.stdout)
    served = {r["model_id"]: {h["peer_id"] for h in r["served_by"]} for r in listed}
    assert {r["model_id"]: r["trusted"] for r in listed} == {published["model_id"]: True, rival["model_id"]: False}
    publisher = next(p for p in swarm.processes if p.name == "publisher")
    assert set(served) == {published["model_id"], rival["model_id"]} and not served[rival["model_id"]]
    assert publisher.peer_id in served[published["model_id"]]  # (with the server named by id, when it ran first)

    both = PublisherTrust.of([public_key_text(first_key), public_key_text(second_key)])
    weights = weights_of(client, swarm, trust=both)
    try:
        with pytest.raises(WeightsError, match="several publishers you trust claim the model name 'tiny-claimed' "
                                               "for different models: choose one of tiny-claimed@"):
            weights.resolve("tiny-claimed")
        source = weights.resolve(f"tiny-claimed@{published['publisher']}")
        assert source.path.parent.name == published["model_id"]
        with pytest.raises(WeightsError, match="no model is published under 'tiny-claimed' by publisher 0123"):
            weights.resolve("tiny-claimed@0123456789abcdef")
        weights.trust = PublisherTrust.of(["none"])
        with pytest.raises(WeightsError, match="names are not resolved here .*: name the model by its id"):
            weights.resolve("tiny-claimed")
        weights.trust = PublisherTrust.of([public_key_text(second_key)])  # the name is the rival's (served by none)
        with pytest.raises(WeightsError, match=f"model {rival['model_id']}: no peer serves it now"):
            weights.resolve("tiny-claimed")
    finally:
        weights.close()


def test_a_record_signed_by_another_key_than_its_slot_is_refused(swarm, peer, client, tmp_path, cache_home,
                                                                  model_id):
    dht, _ = peer
    owner, forger = tmp_path / "owner.key", tmp_path / "forger.key"
    owner_key, forger_key = generate_private_key(owner), generate_private_key(forger)
    record = PublishedModel("tiny-forged", model_id, 100, 100, time.time())
    expiration = now() + 600
    forged = sign_slot(forger_key, name_key("tiny-forged"), record.payload(), expiration)
    assert not dht.store(name_key("tiny-forged"), forged, expiration_time=expiration, subkey=slot_subkey(owner_key))
    assert read_published(dht, "tiny-forged") == []
    trust = PublisherTrust.of([public_key_text(owner_key), public_key_text(forger_key)])
    weights = weights_of(client, swarm, trust=trust)
    try:
        with pytest.raises(WeightsError, match="no publisher you trust .* published 'tiny-forged'"):
            weights.resolve("tiny-forged")
        assert weights._dht is None, "dht=: read through the caller's peer, with no DHT peer of its own"
    finally:
        weights.close()
    assert client.is_alive(), "dht=: the caller's peer is never closed by the resolver"


def test_the_fetch_command_fills_the_cache_with_the_parts_named(swarm, model_id, cache_home, tiny_model_path):
    peers = [arg for peer in swarm.initial_peers for arg in ("--initial-peers", peer)]
    result = CliRunner().invoke(weights_main, ["fetch", model_id, "--blocks", "3:4", "--head", *peers])
    assert result.exit_code == 0, result.output
    directory = Path(result.stdout.strip().splitlines()[-1])
    assert directory == cache_home / "swarm" / "weights" / model_id / tiny_model_path.name
    names = [t.name for t in build_manifest(tiny_model_path).tensors]
    wanted = blocks_of(names, 3) | {names.index("norm.weight"), names.index("lm_head.weight")}
    assert {p.name for p in directory.glob("t-*.safetensors")} == {tensor_file(i) for i in wanted}
    again = CliRunner().invoke(weights_main, ["fetch", model_id, "--blocks", "3:4"])  # installed: no swarm needed
    assert again.exit_code == 0, again.output


def checked_parts(manifest, directory: Path) -> int:
    """Parts in the partial files under ``directory`` whose bytes match the manifest."""
    count = 0
    for path in (directory / "partial").glob("t-*.safetensors"):
        entry = manifest.tensors[int(path.name[2:7])]
        data = path.read_bytes()[-entry.size:]
        count += sum(sha256_hex(data[start:start + length]) == entry.parts[part]
                     for part, (start, length) in enumerate(map(entry.part, range(len(entry.parts)))))
    return count


def test_a_fetch_killed_midway_resumes_from_the_parts_it_checked(
        swarm, peer, client, hostile, tiny_model_path, tmp_path, cache_home):
    """A real crash: ``python -m swarm.weights fetch`` (a process of its own) is SIGKILLed while a slow peer feeds
    it; the next fetch asks only for the parts that were not checked yet."""
    dht, identity = peer
    other = make_checkpoint(tmp_path / "other" / tiny_model_path.name, tiny_config(), seed=7)
    saved_holdings, saved_bandwidth = hostile.holdings, hostile.bandwidth
    hostile.mode, hostile.holdings, hostile.bandwidth = None, Holdings.of_model(other), Bandwidth(0.1)  # 12.5 kB/s
    manifest = hostile.holdings.manifest
    try:
        record = hostile.holdings.host_record(hostile.peer_id, hostile.addresses)
        assert declare_host(dht, manifest.model_id, record, identity.owner_subkey(), now() + 120)
        # forked from the swarm's fork server (torch and hivemind imported: exec'd, 2-2.5 CPU s more); SIGKILL takes
        # it and its DHT process and daemon at once, as a crash does
        fetching = swarm.start_command("fetch", ["-m", "swarm.weights", "fetch", manifest.model_id, "--blocks", "0:4",
                                                 *[arg for p in swarm.initial_peers for arg in ("--initial-peers", p)]],
                                       env={"HF_HOME": str(cache_home)})
        directory = cache_home / "swarm" / "weights" / manifest.model_id
        try:
            assert wait_until(lambda: checked_parts(manifest, directory) >= 4, timeout=90), fetching.log[-20:]
        finally:
            swarm.terminate(fetching, signal.SIGKILL)
        kept = checked_parts(manifest, directory)
        hostile.bandwidth = saved_bandwidth
        weights = weights_of(client, swarm)
        try:
            files = ModelFiles(manifest.model_id, resolvers=[weights.resolve])
            files.span(0, 4)
        finally:
            weights.close()
        report = weights.reports[-1]
        assert report.parts_resumed >= kept >= 4  # (a part may have been written between the count and the kill)
        wanted = blocks_of([t.name for t in manifest.tensors], 0, 1, 2, 3)
        assert report.parts + report.parts_resumed == sum(len(manifest.tensors[i].parts) for i in wanted)
        for index in wanted:
            entry = manifest.tensors[index]
            assert sha256_hex(files.path.joinpath(tensor_file(index)).read_bytes()[-entry.size:]) == entry.sha256
    finally:
        hostile.holdings, hostile.bandwidth = saved_holdings, saved_bandwidth


# ----- issue 48: no peer punished on a stranger's claim; names with trust roots; publish read back ---------------
def test_lying_hints_in_strangers_records_ban_nobody(swarm, client, liars, model_id, tiny_model_path, cache_home,
                                                     tmp_path, monkeypatch):
    """A fetch by id and by name (what ``python -m swarm.weights fetch`` and ``swarm.server --model`` run, here
    through this process's client peer) with the liars' records (sizes one byte short and long, a claim to hold every
    tensor): it works, and the honest host is never banned. A name record whose signed size is wrong (by a trusted
    publisher) is a hint too."""
    publisher = next(p for p in swarm.processes if p.name == "publisher").peer_id

    key = generate_private_key(tmp_path / "publisher.key")
    size = len(build_manifest(tiny_model_path).to_bytes())
    publish(client, key, PublishedModel("tiny-short", model_id, size - 1, 1, time.time()))
    for home in ("by-id", "by-name"):  # fresh caches: the manifest is fetched again
        monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / home))
        weights = weights_of(client, swarm, trust=PublisherTrust.of([public_key_text(key)]))
        try:
            files = ModelFiles(model_id if home == "by-id" else "tiny-short", resolvers=[weights.resolve])
            files.span(0, 2)
        finally:
            weights.close()
        assert files.path.parent.name == model_id
        assert publisher not in weights.banned, weights.banned
        # the running ones: a server another test stopped can still be announced as a host, and failing to read
        # from it is a real failure (a shuffled run banned one)
        running = {p.peer_id for p in swarm.processes if p.alive}
        assert not set(weights.banned) & running, "no honest server is banned"


def negated_copy(source: Path, target: Path) -> Path:
    """A copy of the checkpoint with one tensor negated (the squatter's model)."""
    shutil.copytree(source, target)
    path = next(target.glob("*.safetensors"))
    tensors = load_file(path)
    name = next(n for n in sorted(tensors) if "mlp" in n)
    tensors[name] = -tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})
    return target


def test_a_squatted_name_changes_nothing_for_a_default_user(swarm, client, tiny_model_path, tmp_path, cache_home,
                                                            monkeypatch):
    """Issue 48, item 3: a stranger publishes a popular name first, for the model with one tensor negated. A
    default user (trusting the governance keys, here the honest publisher's) installs nothing; once the honest
    publisher publishes, the name is the honest model for the fetch command and for ``swarm.server --model NAME``,
    with no "several publishers" error."""
    honest_key = generate_private_key(tmp_path / "honest.key")
    stranger = tmp_path / "stranger.key"
    generate_private_key(stranger)
    squatted = negated_copy(tiny_model_path, tmp_path / "squat" / tiny_model_path.name)
    squat = publish_through(client, squatted, "tiny-popular", stranger)
    monkeypatch.setenv("SWARM_GOVERNANCE_KEYS", public_key_text(honest_key))
    peers = [arg for peer in swarm.initial_peers for arg in ("--initial-peers", peer)]
    refused = CliRunner().invoke(weights_main, ["fetch", "tiny-popular", *peers])
    assert refused.exit_code == 2 and "no publisher you trust (the governance keys) published 'tiny-popular' (1 " \
        "records by publishers you do not trust are ignored)" in refused.output, refused.output
    assert not (cache_home / "swarm" / "weights" / squat["model_id"]).exists()

    honest = publish_through(client, tiny_model_path, "tiny-popular", tmp_path / "honest.key")
    fetched = CliRunner().invoke(weights_main, ["fetch", "tiny-popular", *peers])
    assert fetched.exit_code == 0, fetched.output
    assert Path(fetched.stdout.strip().splitlines()[-1]).parent.name == honest["model_id"] != squat["model_id"]
    assert not (cache_home / "swarm" / "weights" / squat["model_id"]).exists()

    pub = tmp_path / "honest.pub"
    pub.write_text(public_key_text(honest_key))
    server = swarm.start_server("tiny-popular", "0:1", "--compute-threads", "1", "--governance-key", str(pub),
                                "--governance-stale-after", "0", name="by-name")
    try:
        assert any(f"model 'tiny-popular' is {honest['model_id']}" in line for line in server.log), server.log[-20:]
    finally:
        swarm.terminate(server)


async def _fill_key(dht, node, key: str, peers: list[str], count: int) -> None:
    """Issue 48's flood: ``count`` one-byte plain subkeys under ``key`` on each of ``peers`` (in batches)."""
    value, expiration = MSGPackSerializer.dumps(b"x"), now() + 600
    subkeys = [f"squat-{i}".encode() for i in range(count)]
    for peer in peers:
        for start in range(0, count, 256):
            batch = subkeys[start:start + 256]
            await node.protocol.call_store(PeerID.from_base58(peer), [DHTID.generate(source=key)] * len(batch),
                                           [value] * len(batch), expiration, subkeys=batch)


def test_a_publish_succeeds_only_when_other_peers_return_it(swarm, peer, client, tiny_model_path, tmp_path):
    """Issue 48, item 2's flood: 1,024 one-byte plain subkeys under a name key before it is published. A publish
    that reports success (exit 0) is read back by another peer; one that is not readable says so and fails
    (exit 1) instead of "published ... rc 0" (where storing peers refuse the flood, the first happens)."""
    dht, _ = peer
    key = tmp_path / "flooded.key"
    generate_private_key(key)
    attacker = plain_attacker(swarm.initial_peers)
    try:
        storing = [p.peer_id for p in swarm.processes if p.alive and p.peer_id] + [str(dht.peer_id)]
        attacker.run_coroutine(partial(_fill_key, key=name_key("tiny-flooded"), peers=storing, count=1024))
    finally:
        attacker.shutdown()  # gone, as a flooder may be: its subkeys stay on the peers it flooded
    peers = [arg for p in swarm.initial_peers for arg in ("--initial-peers", p)]
    result = CliRunner().invoke(weights_main, ["publish", str(tiny_model_path), "--name", "tiny-flooded",
                                               "--key", str(key), *peers])
    readable = [r.model_id for r in read_published(client, "tiny-flooded")]  # another peer than the command's
    if result.exit_code == 0:
        assert readable == [build_manifest(tiny_model_path).model_id], "a publish said success for an unread record"
    else:
        assert result.exit_code == 1 and "other peers do not return it: it is not readable, so it is not " \
            "published" in result.output, result.output
        assert "published 'tiny-flooded'" not in result.output


@pytest.mark.parametrize("command", [["show", "tiny"], ["publish", ".", "--name", "tiny", "--key", __file__]])
def test_commands_that_need_a_swarm_refuse_to_run_without_one(command, monkeypatch):
    monkeypatch.delenv("SWARM_INITIAL_PEERS", raising=False)
    monkeypatch.setenv("SWARM_BOOTSTRAP_FILE", os.devnull)
    result = CliRunner().invoke(weights_main, command)
    assert result.exit_code == 2 and "no swarm to work on: pass --initial-peers" in result.output, result.output


def test_a_full_disk_is_a_one_line_error(swarm, client, model_id, full_disk, monkeypatch):  # noqa: F811 (fixture)
    monkeypatch.setattr(constants, "HF_HOME", str(full_disk))
    weights = weights_of(client, swarm)
    try:
        files = ModelFiles(model_id, resolvers=[weights.resolve])  # the manifest and config fit
        with pytest.raises(WeightsError, match=f"model {model_id}: no space left on the disk of .*: free some, or "
                                               "point HF_HOME at a larger disk"):
            files.span(0, 4)
    finally:
        weights.close()
