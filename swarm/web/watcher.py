"""Reading the swarm for the map page: the DHT's health map, one ping per server, the governance state.

One :class:`SwarmWatcher` serves every open page: a snapshot is reused for ``min_interval`` seconds, so ten
browsers polling every few seconds cost one DHT read and one ping per server, not ten. The API's watcher reads
through its client (same DHT peer, and the client's own bans and route); ``python -m swarm.health --serve``
starts a DHT peer of its own (:func:`own_access`).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hivemind.dht import DHT

from swarm.dht.node import NetworkConfig, start_dht, stop_dht
from swarm.dht.schema import ServerRecord, ServerState
from swarm.governance.guard import GovernanceGuard
from swarm.health.map import read_health_map
from swarm.utils.event_loop import BackgroundLoop
from swarm.web.snapshot import ClientView, Probe, governance_view, map_snapshot
from swarm.wire.remote import RemoteCaller

logger = logging.getLogger(__name__)


@dataclass
class WatchConfig:
    """How hard the map looks at the swarm."""

    probe_timeout: float = 2.0  # seconds a server has to answer the ping, in parallel with the others
    min_interval: float = 2.0  # a snapshot younger than this is answered again instead of reading the swarm
    read_timeout: float = 20.0  # how long a first caller waits for a read another caller started


@dataclass
class SwarmAccess:
    """The handles a watcher reads the swarm through: a client's own, or a DHT peer started for the page."""

    dht: DHT
    prefix: str
    num_blocks: int
    caller: RemoteCaller
    loop: BackgroundLoop
    guard: GovernanceGuard
    client: Callable[[], ClientView] = ClientView  # what a client knows of the servers; empty without one
    close: Callable[[], None] = lambda: None


def client_access(lm: Any) -> SwarmAccess:
    """Read through a :class:`~swarm.client.DistributedDiffusionLM`: its DHT peer, pings, bans and route."""
    planner = lm.planner

    def client() -> ClientView:
        route = list(planner.route)
        distrusted = planner.health.distrusted
        return ClientView(banned=planner.health.excluded() - distrusted, distrusted=distrusted,
                          route=tuple(map(str, route)), route_peers=frozenset(hop.peer_id for hop in route))

    return SwarmAccess(lm.dht, lm.prefix, lm.config.num_layers, lm.caller, lm.loop, lm.guard, client)


def own_access(network: NetworkConfig, prefix: str, num_blocks: int) -> SwarmAccess:
    """Start a DHT peer for the page alone; governance keys come from ``$SWARM_GOVERNANCE_KEYS``."""
    dht = start_dht(network)
    loop = BackgroundLoop.shared()
    try:
        p2p = loop.run(dht.replicate_p2p())
    except BaseException:
        stop_dht(dht)
        raise

    def close() -> None:
        try:
            loop.run(p2p.shutdown(), timeout=5)
        finally:
            stop_dht(dht)

    return SwarmAccess(dht, prefix, num_blocks, RemoteCaller(p2p), loop, GovernanceGuard(dht, prefix), close=close)


def in_flight_of(info: Any) -> Optional[int]:
    """Requests a server says it is computing or queueing (``rpc_info``'s admission counts), or None."""
    admission = info.get("admission") if isinstance(info, dict) else None
    if not isinstance(admission, dict):
        return None
    counts = [queue.get("in_flight") for queue in admission.values() if isinstance(queue, dict)]
    counts = [count for count in counts if isinstance(count, int) and not isinstance(count, bool) and count >= 0]
    return sum(counts) if counts else None


async def probe(caller: RemoteCaller, record: ServerRecord, timeout: float) -> Probe:
    """Ask one server for its self-description; dial its announced addresses once if the first try fails."""
    try:
        try:
            info, rtt = await caller.info(record.peer_id, timeout)
        except Exception:
            if not record.addresses:
                raise
            await caller.connect(record.peer_id, record.addresses, timeout)
            info, rtt = await caller.info(record.peer_id, timeout)
    except Exception as error:  # any failure is something to show on the page, not to raise
        return Probe(error=str(error) or type(error).__name__)
    return Probe(rtt_ms=round(rtt * 1000, 1), in_flight=in_flight_of(info))


async def probe_all(caller: RemoteCaller, records: list[ServerRecord], timeout: float) -> dict[str, Probe]:
    """Ping every server that has not announced it left, all at once."""
    live = [record for record in records if record.state != ServerState.OFFLINE]
    found = await asyncio.gather(*(probe(caller, record, timeout) for record in live))
    return {record.peer_id: result for record, result in zip(live, found)}


@dataclass
class SwarmWatcher:
    """Snapshots of the swarm for ``/map.json``; thread-safe, one read of the swarm at a time."""

    access: SwarmAccess
    source: str  # "api" or "health": who serves the page
    playground: bool  # whether the same server offers the playground page
    config: WatchConfig = field(default_factory=WatchConfig)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _cached: Optional[dict[str, Any]] = field(default=None, init=False, repr=False)
    _cached_at: float = field(default=float("-inf"), init=False, repr=False)

    def snapshot(self) -> dict[str, Any]:
        """Blocking (DHT reads and pings): call it from a worker thread.

        While one read runs, other callers get the previous snapshot instead of queueing behind it (a slow or
        stuck DHT must not hold one worker thread per open page); with none yet they wait ``read_timeout``.
        """
        previous = self._cached
        if previous is not None and not self._lock.acquire(blocking=False):
            return previous
        if previous is None and not self._lock.acquire(timeout=self.config.read_timeout):
            raise TimeoutError(f"the swarm map is still being read after {self.config.read_timeout:.0f} s")
        try:
            if self._cached is None or time.monotonic() - self._cached_at >= self.config.min_interval:
                self._cached = self._read()
                self._cached_at = time.monotonic()
            return self._cached
        finally:
            self._lock.release()

    def _read(self) -> dict[str, Any]:
        access, started = self.access, time.perf_counter()
        health = read_health_map(access.dht, access.prefix, access.num_blocks)
        probes = access.loop.run(probe_all(access.caller, health.servers, self.config.probe_timeout),
                                 timeout=2 * self.config.probe_timeout + 5)
        snapshot = map_snapshot(health, probes, access.client(), self._governance(), self.source, self.playground)
        logger.debug("read the map of %s in %.0f ms: %d servers, %d answered the ping", access.prefix,
                     1000 * (time.perf_counter() - started), len(health.servers),
                     sum(probe.error is None for probe in probes.values()))
        return snapshot

    def _governance(self) -> dict[str, Any]:
        guard = self.access.guard
        if not guard.enabled:
            return governance_view(False)
        return governance_view(True, guard.current(force=True))

    def close(self) -> None:
        self.access.close()
