"""A client behind wide-area links: every peer behind a TCP proxy that delays every crossing (issue 54).

The proxies (:mod:`swarm.testing.delay_proxy`) delay what the protocol really sends, so these tests count what a
step really waits for: a synchronous step with push crosses three times (client, first server, second server,
client), hop by hop four, and no step opens a connection. They count crossings from the order of events, never
time a step. At three times the delay a generation in every mode finishes with no server avoided.
"""
from __future__ import annotations

import time

import pytest

from swarm.client import DistributedDiffusionLM
from swarm.testing.delay_proxy import Crossing, CrossingLog, DelayedLinks, DelayedSwarm, daemon_process

DELAY = 0.05
SETTINGS = dict(gen_length=16, steps=8, block_length=16, temperature=0.0, draft_steps=0)
PROMPT = "far away"


@pytest.fixture(scope="module")
def links():
    links = DelayedLinks(DELAY)
    yield links
    links.close()


@pytest.fixture(scope="module")
def wan_swarm(links, tiny_model_path, local_swarm):
    """A bootstrap peer and servers 0:2 and 2:4, each behind its own proxy; announcing rarely, so that the servers'
    own DHT traffic seldom falls inside a step. Forked from the shared swarm's fork server (a fork server of its own
    cost ~1.5 CPU s); their DHT is their own, which no peer of the shared swarm (behind no proxy) joins."""
    with DelayedSwarm(links, shared_forks=local_swarm.forks) as swarm:
        swarm.start_bootstrap()
        servers = [swarm.start_server(str(tiny_model_path), span, "--compute-threads", "1", "--update-period", "60",
                                      wait=False) for span in ("0:2", "2:4")]
        for server in servers:
            swarm.wait_ready(server)
        yield swarm


@pytest.fixture(scope="module")
def wan_peer(wan_swarm):
    """The clients' DHT peer, behind no proxy (so the log tells the client's process from the servers'), shared by
    the file's clients: a client's own DHT is a DHT process and a libp2p daemon, ~0.6 CPU s, and no test here is
    about the caller's identity."""
    from swarm.dht.node import NetworkConfig, start_dht, stop_dht

    dht = start_dht(NetworkConfig(initial_peers=wan_swarm.initial_peers, client_mode=True))
    yield dht
    stop_dht(dht)


def step_chains(lm, links: DelayedLinks, **settings) -> tuple[list[int], int, int]:
    """Each step's crossings waited for one after the other, the whole generation's, and the connections opened
    during it. A step's window is read when the stream yields it, so a call sent before that yield (the stream
    runs ahead of its reader) counts in the step before: steps may trade a crossing, the whole cannot."""
    marks = [time.monotonic()]
    for _ in lm.generate_stream(PROMPT, **SETTINGS, **settings):
        marks.append(time.monotonic())
    client = daemon_process(lm.p2p)
    assert client in links.log.outsiders(marks[0], marks[-1]), "the client dialled no proxy"
    whole = links.log.chain(marks[0], marks[-1], client)
    return ([chain for chain in links.log.steps(marks, client) if chain], whole,
            links.log.connections(marks[0], marks[-1], client))


@pytest.mark.parametrize("push, crossings", [(True, 3), (False, 4)])
def test_a_synchronous_step_crosses_only_what_its_route_needs(wan_peer, links, tiny_model_path, push, crossings):
    with DistributedDiffusionLM.from_pretrained(tiny_model_path, dht=wan_peer, push=push, spot_check_fraction=0) as lm:
        lm.generate(PROMPT, **SETTINGS)  # connections, challenges and the route, once
        chains, whole, opened = step_chains(lm, links)
        assert opened == 0, "a step opened a connection: it pays a handshake at every step"
        assert len(chains) >= SETTINGS["steps"] - 1
        assert sorted(chains)[len(chains) // 2] == crossings, chains
        # a server's DHT announcement that happens to fall inside a pass may add its two crossings
        assert crossings * SETTINGS["steps"] <= whole <= crossings * SETTINGS["steps"] + 2, (whole, chains)
        if push:
            assert lm.sequence.receiver.stats.delivered >= SETTINGS["steps"]


def test_every_mode_finishes_at_three_times_the_delay_with_no_server_avoided(wan_peer, links, tiny_model_path):
    links.delay = 3 * DELAY
    try:
        with DistributedDiffusionLM.from_pretrained(tiny_model_path, dht=wan_peer, push=True,
                                                    spot_check_fraction=0) as lm:
            reference = lm.generate(PROMPT, **SETTINGS)
            for mode in ({"cache": "dual"}, {"staleness": 3, "cache": "dual"}, {"staleness": 2}):
                result = lm.generate(PROMPT, **SETTINGS, **mode)
                assert len(result.token_ids) == len(reference.token_ids)
            assert lm.sequence.failovers == []
            assert lm.planner.health.excluded() == frozenset()
            assert lm.sequence.receiver.stats.undelivered == 0
    finally:
        links.delay = DELAY


# ----- the log's arithmetic, on made-up crossings ----------------------------------------------------------
def crossing(sender: str, receiver: str, sent: float, arrived: float, upstream: bool = True) -> Crossing:
    return Crossing("link", 1, upstream, sender, receiver, sent, arrived, 10)


def test_the_chain_follows_who_sent_what_after_it_arrived():
    log = CrossingLog()
    for made in (crossing("client", "s1", 0.0, 1.0), crossing("s1", "client", 1.5, 2.5, upstream=False),  # the ack
                 crossing("s1", "s2", 1.5, 2.5), crossing("s2", "client", 3.0, 4.0, upstream=False),
                 crossing("boot", "s2", 2.6, 3.0),  # chatter that arrives at s2 meanwhile: in no chain from client
                 crossing("client", "s2", 2.6, 3.6)):  # sent after the ack arrived, by another process than s2
        log.add(made)
    assert log.chain(0.0, 5.0, origin="client") == 3
    assert log.chain(0.0, 3.9, origin="client") == 2  # the delivery arrives after the window: the ack ends it
    assert log.outsiders() == {"client", "boot"}


def test_a_stranger_dialling_a_proxy_changes_no_count_of_the_named_client():
    """On a busy machine another program's peer may dial a proxy's port (a stale address whose port the proxy took
    since): named, the client's steps and connections leave the stranger's out (CI once saw two outsiders)."""
    log = CrossingLog()
    opening = time.monotonic()
    mine, theirs = log.connection("link"), log.connection("link")
    for made in (Crossing("link", mine, True, "client", "s1", 0.0, 1.0, 10),
                 Crossing("link", mine, False, "s1", "client", 1.5, 2.5, 10),
                 Crossing("link", theirs, True, "stranger", "s1", 0.5, 1.2, 10),
                 Crossing("link", theirs, False, "s1", "stranger", 1.3, 1.9, 10),
                 Crossing("link", theirs, True, "stranger", "s1", 2.0, 2.4, 10)):
        log.add(made)
    marks = [0.0, 3.0]
    assert log.outsiders() == {"client", "stranger"}
    assert log.steps(marks) == [log.chain(0.0, 3.0)]  # two outsiders, no origin: any chain, the stranger's too
    assert log.steps(marks, "client") == [2]
    assert log.connections(opening, time.monotonic(), "client") == 1
    assert log.connections(opening, time.monotonic()) == 2
