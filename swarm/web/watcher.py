"""Reading the swarm for the map page: the DHT's health map, one ping per server, the governance state, the
trusted auditors' reports and the published adapters.

One :class:`SwarmWatcher` serves every open page: a snapshot is reused for ``min_interval`` seconds, so ten
browsers polling every few seconds cost one DHT read, one ping per server (``rpc_info``: its round trip, load and
usage counts) and one read per trusted auditor, not ten. The API's watcher reads through its client (same DHT peer,
the client's own bans and route, and its book of audit reports, refreshed for both); ``python -m swarm.health
--serve`` starts a DHT peer of its own (:func:`own_access`) and a book of the auditors it trusts.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from hivemind.dht import DHT

from swarm.dht.node import NetworkConfig, start_dht, stop_dht
from swarm.dht.schema import ServerRecord, ServerState, protected_keys
from swarm.governance.guard import GovernanceGuard
from swarm.health.map import audits_of, read_adapters, read_health_map
from swarm.health.probe import InfoReply, ask_all, usage_of
from swarm.reports.records import AuditBook
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
    adapters_interval: float = 30.0  # the published adapters (a read per name) are read again after this long


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
    audits: Optional[AuditBook] = None  # the trusted auditors' reports (None or empty: the page trusts none)
    coordinators: tuple[str, ...] = ()  # the stream coordinators whose records the page shows (base64 keys)


def client_access(lm: Any) -> SwarmAccess:
    """Read through a :class:`~swarm.client.DistributedDiffusionLM`: its DHT peer, pings, bans and route."""
    planner = lm.planner

    def client() -> ClientView:
        route = list(planner.route)
        distrusted = planner.health.distrusted
        return ClientView(banned=planner.health.excluded() - distrusted, distrusted=distrusted,
                          route=tuple(map(str, route)), route_peers=frozenset(hop.peer_id for hop in route))

    return SwarmAccess(lm.dht, lm.prefix, lm.config.num_layers, lm.caller, lm.loop, lm.guard, client,
                       audits=planner.audits)  # the reports of ClientConfig.trusted_auditors


def own_access(network: NetworkConfig, prefix: str, num_blocks: int, auditors: Iterable[str] = (),
               coordinators: Iterable[str] = (), dht: Optional[DHT] = None) -> SwarmAccess:
    """Start a DHT peer for the page alone; governance keys come from ``$SWARM_GOVERNANCE_KEYS``, the trusted
    auditors and stream coordinators (base64 keys, ``swarm.reports.records.trusted_auditors``) from the caller.
    ``dht``: a peer the caller already runs instead (its keys' protection is the caller's; closing leaves it and its
    connection to the daemon up)."""
    auditors, coordinators = tuple(auditors), tuple(coordinators)
    own = dht is None
    if own:
        dht = start_dht(network, protect=protected_keys(prefix, num_blocks, auditors=auditors,
                                                        coordinators=coordinators))
    loop = BackgroundLoop.shared()
    try:
        p2p = loop.run(dht.replicate_p2p())
    except BaseException:
        if own:
            stop_dht(dht)
        raise

    def close() -> None:
        if not own:
            return  # the caller's peer, and its connection to the daemon (replicate_p2p gives each caller the same)
        stop_dht(dht)  # closes its connection to the daemon first

    return SwarmAccess(dht, prefix, num_blocks, RemoteCaller(p2p), loop, GovernanceGuard(dht, prefix), close=close,
                       audits=AuditBook(prefix, frozenset(auditors)) if auditors else None, coordinators=coordinators)


def in_flight_of(info: Any) -> Optional[int]:
    """Requests a server says it is computing or queueing (``rpc_info``'s admission counts), or None."""
    admission = info.get("admission") if isinstance(info, dict) else None
    if not isinstance(admission, dict):
        return None
    counts = [queue.get("in_flight") for queue in admission.values() if isinstance(queue, dict)]
    counts = [count for count in counts if isinstance(count, int) and not isinstance(count, bool) and count >= 0]
    return sum(counts) if counts else None


def probe_of(reply: InfoReply) -> Probe:
    """What the page shows of one ``rpc_info`` answer: round trip, load and usage counts, or why there is none."""
    if reply.error is not None:
        return Probe(error=reply.error)
    return Probe(rtt_ms=round(reply.rtt * 1000, 1), in_flight=in_flight_of(reply.info), usage=usage_of(reply.info))


async def probe_all(caller: RemoteCaller, records: list[ServerRecord], timeout: float) -> dict[str, Probe]:
    """Ping every server that has not announced it left, all at once."""
    live = [record for record in records if record.state != ServerState.OFFLINE]
    return {peer: probe_of(reply) for peer, reply in (await ask_all(caller, live, timeout)).items()}


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
    _adapters: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)
    _adapters_at: float = field(default=float("-inf"), init=False, repr=False)
    _failing: dict[str, float] = field(default_factory=dict, init=False, repr=False)  # peer -> first failed probe

    def _unreachable_since(self, probes: dict[str, Probe]) -> dict[str, float]:
        """Per server whose probe failed, since when its probes have failed (reset once it answers again)."""
        now = time.time()
        self._failing = {peer: self._failing.get(peer, now) for peer, probe in probes.items()
                         if probe.error is not None}
        return dict(self._failing)

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
        health = read_health_map(access.dht, access.prefix, access.num_blocks,  # probed below, by its own caller
                                 coordinators=access.coordinators)
        health.adapters = self._published_adapters()
        book = access.audits if access.audits is not None and access.audits.enabled else None
        if book is not None:
            book.refresh(access.dht)  # one read per trusted auditor, never raises
            health.audits = audits_of(book, health.adapters)
        probes = access.loop.run(probe_all(access.caller, health.servers, self.config.probe_timeout),
                                 timeout=3 * self.config.probe_timeout + 5)
        health.mark_unreachable(self._unreachable_since(probes))
        snapshot = map_snapshot(health, probes, access.client(), self._governance(), self.source, self.playground,
                                book.trusted if book is not None else ())
        logger.debug("read the map of %s in %.0f ms: %d servers, %d answered the ping", access.prefix,
                     1000 * (time.perf_counter() - started), len(health.servers),
                     sum(probe.error is None for probe in probes.values()))
        return snapshot

    def _published_adapters(self) -> list[dict[str, Any]]:
        """The published adapters, read again at most every ``adapters_interval`` (each name costs DHT reads);
        copies, since the audits are added to them per read."""
        if time.monotonic() - self._adapters_at >= self.config.adapters_interval:
            try:
                self._adapters = read_adapters(self.access.dht, self.access.prefix)
            except Exception as error:  # the rest of the map is still worth showing
                logger.warning("could not read the published adapters of %s: %r", self.access.prefix, error)
            self._adapters_at = time.monotonic()
        return [dict(adapter) for adapter in self._adapters]

    def _governance(self) -> dict[str, Any]:
        guard = self.access.guard
        if not guard.enabled:
            return governance_view(False)
        return governance_view(True, guard.current(force=True))

    def close(self) -> None:
        self.access.close()
