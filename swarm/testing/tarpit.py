"""Weight hosts on bare libp2p peers of this process, for the tarpit test and benchmark (issue 48, item 6).

A :class:`TarpitWeightServer` is the real :class:`~swarm.weights.service.WeightServer`, answering every read
with the right bytes but only after ``delay`` seconds (a tarpit sets it just under the reader's deadline). With
``delay`` 0 it is an honest host. :func:`start_host` puts one on a fresh :class:`~hivemind.p2p.P2P` (no DHT: the
fetcher is given the hosts' records directly), listening on 127.0.0.1.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from swarm.dht.node import create_p2p
from swarm.utils.event_loop import BackgroundLoop
from swarm.weights.holdings import Holdings
from swarm.weights.records import HostRecord
from swarm.weights.service import WeightServer


class TarpitWeightServer(WeightServer):
    """Serves correct bytes, each read after ``delay`` seconds; counts the reads it was asked."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay = delay
        self.reads_asked = 0

    async def rpc_read(self, request: runtime_pb2.ExpertRequest,
                       context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        self.reads_asked += 1
        await asyncio.sleep(self.delay)
        async for message in super().rpc_read(request, context):
            yield message


@dataclass
class Host:
    """One weight host on its own P2P daemon."""

    server: TarpitWeightServer
    p2p: P2P
    record: HostRecord

    def stop(self) -> None:
        BackgroundLoop.shared().run(self.p2p.shutdown())


def start_host(model: Path, delay: float = 0.0) -> Host:
    """A host of every tensor of the checkpoint directory ``model`` answering after ``delay`` seconds."""
    loop = BackgroundLoop.shared()
    server = TarpitWeightServer(delay)
    server.holdings = Holdings.of_model(model)
    p2p = loop.run(create_p2p(), timeout=60)
    loop.run(server.add_p2p_handlers(p2p))
    addresses = tuple(str(address).rsplit("/p2p/", 1)[0] for address in loop.run(p2p.get_visible_maddrs()))
    record = server.holdings.host_record(str(p2p.peer_id), list(addresses))
    return Host(server, p2p, record)
