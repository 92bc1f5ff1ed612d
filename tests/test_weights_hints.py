"""Issue 48, items 1 and 6, at the fetcher: no peer punished on another's claim, and tarpits cost a bounded share.

Real hosts (the real :class:`WeightServer`, on their own libp2p daemons on 127.0.0.1, holding the tiny
checkpoint) and a real fetcher; no DHT: the fetcher is given the hosts' records, as it reads them from the DHT.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from swarm.dht.node import create_p2p
from swarm.testing.tarpit import start_host
from swarm.utils.event_loop import BackgroundLoop
from swarm.weights.fetch import FetchConfig, Fetcher, PeerBook
from swarm.weights.manifest import build_manifest, sha256_hex
from swarm.weights.records import WeightsNotServed
from tests.test_weights import assert_only_checked_bytes, installed_cache

CONFIG = FetchConfig(timeout=10.0, hedge_after=0.5)


@pytest.fixture(scope="module")
def honest(tiny_model_path):
    host = start_host(tiny_model_path)
    yield host
    host.stop()


@pytest.fixture(scope="module")
def others(tiny_model_path):
    """Four more hosts of the same bytes: liars about sizes, or tarpits (their ``delay`` set by each test)."""
    hosts = [start_host(tiny_model_path) for _ in range(4)]
    yield hosts
    for host in hosts:
        host.stop()


@pytest.fixture(scope="module")
def client():
    """The fetchers' libp2p peer, one for the file (a daemon is ~0.4 CPU s to start): each test's fetcher keeps its
    own book of the hosts."""
    loop = BackgroundLoop.shared()
    p2p = loop.run(create_p2p(), timeout=60)
    yield p2p
    loop.run(p2p.shutdown())


def fetcher_of(client, model_id: str, records, config: FetchConfig = CONFIG) -> Fetcher:
    fetcher = Fetcher(client, model_id, PeerBook(records, config), config)
    BackgroundLoop.shared().run(fetcher.connect())
    return fetcher


def test_sizes_claimed_by_others_ban_nobody(honest, others, client, tiny_model_path):
    """The issue's attack: records claiming the manifest is a byte shorter (two of them: the most claimed size)
    or longer, and a name record claiming the short size. The manifest still comes; only a host that failed the
    size *it* claimed is punished, never the honest host."""
    manifest = build_manifest(tiny_model_path)
    size = len(manifest.to_bytes())
    for host in others:
        host.server.delay = 0.0
    short, short_too, long, honest_twin = others
    records = [replace(short.record, manifest_bytes=size - 1), replace(short_too.record, manifest_bytes=size - 1),
               replace(long.record, manifest_bytes=size + 1), honest.record, honest_twin.record]
    fetcher = fetcher_of(client, manifest.model_id, records)
    data = BackgroundLoop.shared().run(fetcher.read_manifest(hinted=size - 1), timeout=60)
    assert sha256_hex(data) == manifest.model_id
    book = fetcher.book
    assert honest.record.peer_id not in book.banned and honest_twin.record.peer_id not in book.banned
    assert not book.strikes[honest.record.peer_id] and not book.strikes[honest_twin.record.peer_id]
    # a host asked for the size it claimed itself and sending other bytes failed on its own terms: banned
    assert set(book.banned) <= {short.record.peer_id, short_too.record.peer_id}
    assert "hash differs" in book.banned[short.record.peer_id]

    # only liars: nobody delivers, and the error says what each host was asked
    liars = fetcher_of(client, manifest.model_id, records[:3])
    with pytest.raises(WeightsNotServed, match=r"the manifest \(\d+ bytes, as its own record says\)"):
        BackgroundLoop.shared().run(liars.read_manifest(), timeout=60)


def test_tarpits_are_hedged_dropped_and_serve_nothing(honest, others, client, tiny_model_path, tmp_path):
    """The issue's tarpits: four hosts sending correct bytes just before the reader's deadline, each allowed as
    many reads as the honest host. Each part they hold past the hedge bound is asked of the honest host too,
    which answers first; each tarpit is then dropped, having been asked at most ``max_per_peer`` reads (those it
    held when first outraced). So the fetch costs the honest fetch plus about one hedge bound, not a deadline per
    round of reads (benchmarks/weights_fetch.py --tarpits measures it)."""
    for host in others:
        host.server.delay, host.server.reads_asked = CONFIG.timeout - 1.0, 0
    manifest, cache = installed_cache(tiny_model_path, tmp_path)
    fetcher = fetcher_of(client, manifest.model_id, [h.record for h in others] + [honest.record])
    wanted = list(range(len(manifest.tensors)))
    report = BackgroundLoop.shared().run(fetcher.fetch_tensors(manifest, cache, wanted), timeout=120)
    tarpits = {host.record.peer_id for host in others}
    assert set(report.bytes_by_peer) == {honest.record.peer_id}, "every part came from the honest host"
    assert set(fetcher.book.dropped) == tarpits and not fetcher.book.banned
    assert report.hedges_won >= len(others)
    for host in others:
        assert 1 <= host.server.reads_asked <= CONFIG.max_per_peer, "a tarpit is asked no more once outraced"
    assert all(cache.tensor_path(manifest, i).exists() for i in wanted)
    assert_only_checked_bytes(manifest, cache)
