"""The swarm's health map: who serves which blocks, and which blocks nobody online serves.

Built in two steps so that the arithmetic is testable without a network: :func:`read_health_map` reads the
DHT records, :func:`build_health_map` turns any set of :class:`ServerRecord` into a :class:`HealthMap`.
Only ONLINE servers count towards coverage: a JOINING server cannot take requests yet and an OFFLINE one
announced that it left, but both are still listed so that an operator sees them. A server's record outlives the
server (it expires after a while), so the map also asks every online server it shows, as a client does before routing
to it (``rpc_info``, a few seconds at most): one that does not answer is listed "unreachable since ..." and does not
count either, so that the map and the client agree within seconds of a server's death (issue 56).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

from hivemind.dht import DHT

from swarm.dht.schema import ServerRecord, ServerState, read_all_experts, read_servers
from swarm.health.reachability import reachability

if TYPE_CHECKING:
    from swarm.reports.records import AuditBook
    from swarm.wire.remote import RemoteCaller

logger = logging.getLogger(__name__)

Span = tuple[int, int]


@dataclass
class ExpertAnnouncement:
    """One peer's expert record for ``domain`` from the index ``{prefix}.experts``: ``value`` is the parsed record's
    value (``ExpertRecord.to_value``), so every field is bounded and JSON-safe."""

    domain: str
    peer_id: str
    value: Any


@dataclass
class HealthMap:
    """Servers of one model and, per block, how many ONLINE servers hold it."""

    prefix: str
    num_blocks: int
    servers: list[ServerRecord]  # sorted by span, then peer id
    replicas: list[int]  # online servers per block
    experts: dict[str, list[ExpertAnnouncement]] = field(default_factory=dict)
    adapters: list[dict[str, Any]] = field(default_factory=list)  # published adapters (read when asked for)
    # per server peer id, its latest check by a trusted auditor (``swarm.reports.records.audit_json``; read when asked)
    audits: dict[str, dict[str, Any]] = field(default_factory=dict)
    # per online server peer id, what it says it computed for its callers (``swarm.server.usage.parse_usage``, None
    # when it did not answer); None when not asked for (``--usage``)
    usage: Optional[dict[str, Optional[dict[str, Any]]]] = None
    # per online server that did not answer the map's probe, since when (epoch seconds): not counted as serving
    unreachable: dict[str, float] = field(default_factory=dict)
    # the domain streams of the trusted coordinators' records (``StreamRecord.views``; read when asked for)
    streams: list[dict[str, Any]] = field(default_factory=list)

    def mark_unreachable(self, since: Mapping[str, float]) -> None:
        """Servers that did not answer a probe (peer id -> since when): listed, no longer counted as serving."""
        self.unreachable = {peer: when for peer, when in since.items()
                            if any(record.peer_id == peer for record in self.servers)}
        self.replicas = count_replicas(self.servers, self.num_blocks, self.unreachable)

    @property
    def uncovered(self) -> list[Span]:
        """Spans (end exclusive) that no online server holds: a client cannot build a route through them."""
        return spans_where(self.replicas, lambda count: count == 0)

    @property
    def fully_served(self) -> bool:
        return self.num_blocks > 0 and not self.uncovered

    def replica_runs(self) -> list[tuple[Span, int]]:
        """Consecutive blocks with the same replica count, e.g. ``[((0, 1), 1), ((1, 4), 2)]``."""
        runs: list[tuple[Span, int]] = []
        for block, count in enumerate(self.replicas):
            if runs and runs[-1][1] == count:
                (start, _), _ = runs[-1]
                runs[-1] = ((start, block + 1), count)
            else:
                runs.append(((block, block + 1), count))
        return runs

    def to_json(self) -> dict[str, Any]:
        """A plain dict for ``--json`` and the HTTP API's ``/health`` (stable keys, no enums)."""
        return {
            "prefix": self.prefix,
            "num_blocks": self.num_blocks,
            "fully_served": self.fully_served,
            "uncovered": [list(span) for span in self.uncovered],
            "replicas": list(self.replicas),
            "servers": [dict(server_json(record), audit=self.audits.get(record.peer_id),
                             unreachable_since=self.unreachable.get(record.peer_id),
                             **({"usage": self.usage.get(record.peer_id)} if self.usage is not None else {}))
                        for record in self.servers],
            "experts": {domain: [{"peer_id": a.peer_id, "value": a.value} for a in found]
                        for domain, found in self.experts.items()},
            "adapters": list(self.adapters),
            "streams": list(self.streams),
        }


def server_json(record: ServerRecord) -> dict[str, Any]:
    return {
        "peer_id": record.peer_id, "public_name": record.public_name, "start": record.start, "end": record.end,
        "state": record.state.name.lower(), "throughput": record.throughput, "version": record.version,
        "cache_tokens_left": record.cache_tokens_left, "experts": list(record.experts),
        "numerics": record.numerics, "approximate": record.approximate,
        "addresses": list(record.addresses), "reachability": reachability(record.addresses), "head": record.head,
        "adapter_kinds": list(record.adapter_kinds),
    }


def spans_where(values: list[int], predicate) -> list[Span]:
    """Maximal runs of indices whose value satisfies ``predicate``, as (start, end) with end exclusive."""
    spans: list[Span] = []
    for index, value in enumerate(values):
        if not predicate(value):
            continue
        if spans and spans[-1][1] == index:
            spans[-1] = (spans[-1][0], index + 1)
        else:
            spans.append((index, index + 1))
    return spans


def format_spans(spans: Iterable[Span]) -> str:
    """``[(3, 6), (8, 9)]`` -> ``"3:6, 8:9"``: the same START:END notation as ``--blocks``."""
    return ", ".join(f"{start}:{end}" for start, end in spans)


def build_health_map(
    servers: Mapping[str, ServerRecord] | Iterable[ServerRecord],
    prefix: str,
    num_blocks: int,
    experts: Mapping[str, list[ExpertAnnouncement]] | None = None,
) -> HealthMap:
    """Count online replicas per block; records reaching past ``num_blocks`` are clipped, not trusted."""
    records = list(servers.values()) if isinstance(servers, Mapping) else list(servers)
    records.sort(key=lambda r: (r.start, r.end, r.peer_id))
    return HealthMap(prefix, num_blocks, records, count_replicas(records, num_blocks), dict(experts or {}))


def count_replicas(records: Iterable[ServerRecord], num_blocks: int, unreachable: Iterable[str] = ()) -> list[int]:
    """Online servers per block, leaving out those that did not answer a probe."""
    skip = set(unreachable)
    replicas = [0] * num_blocks
    for record in records:
        if record.state == ServerState.ONLINE and record.peer_id not in skip:
            for block in range(record.start, min(record.end, num_blocks)):
                replicas[block] += 1
    return replicas


# ----- experts (hook) ---------------------------------------------------------------------------------
def read_experts(dht: DHT, prefix: str) -> dict[str, list[ExpertAnnouncement]]:
    """Peers announcing each expert domain, from one read of the experts index (``read_all_experts``: its
    number of domains is capped). Only entries whose owner key proves their peer id count: nobody can speak for
    another peer."""
    return {domain: [ExpertAnnouncement(domain, peer, record.to_value()) for peer, record in sorted(found.items())]
            for domain, found in sorted(read_all_experts(dht, prefix).items())}


def read_adapters(dht: DHT, prefix: str) -> list[dict[str, Any]]:
    """Published adapters (signed records listed in the adapters index) and the peers serving each now; ``withdrawn``
    when a publisher of any name read withdrew its content (``swarm.adapters.versions``: the content is withdrawn)."""
    from swarm.adapters.sharing import read_catalog  # the sharing module pulls in the adapter code: only if asked
    from swarm.adapters.versions import is_withdrawn, read_versions, withdrawals

    catalog, authors = read_catalog(dht, prefix), {}
    for record, _ in catalog:
        authors.setdefault(record.name, set()).add(record.author_id)
    lists = {name: {listed.author: listed for listed in read_versions(dht, prefix, name, sorted(ids))}
             for name, ids in authors.items()}
    withdrawn = withdrawals(listed for by_author in lists.values() for listed in by_author.values())
    adapters = []
    for record, hosts in catalog:
        listed = lists[record.name].get(record.author)
        versions = [dict(version.to_json(), withdrawn=version.withdrawn or version.sha256 in withdrawn)
                    for version in listed.versions] if listed is not None else []
        adapters.append(dict(record.to_json(), hosts=hosts, versions=versions,
                             withdrawn=is_withdrawn(record, withdrawn)))
    return adapters


def read_audits(dht: DHT, prefix: str, auditors: Iterable[str], adapters: list[dict[str, Any]] = ()
                ) -> dict[str, dict[str, Any]]:
    """Per server, its latest check by one of ``auditors`` (base64 keys): only their signed reports are read. Each of
    ``adapters`` (``read_adapters`` entries) gets ``audits``: its content's latest trusted score per task."""
    from swarm.reports.records import AuditBook  # pulls in the adapter code: only if asked

    book = AuditBook(prefix, frozenset(auditors))
    book.refresh(dht)
    return audits_of(book, adapters)


def audits_of(book: AuditBook, adapters: list[dict[str, Any]] = ()) -> dict[str, dict[str, Any]]:
    """What the maps show of the reports ``book`` holds (no read: a reader that keeps a book, the web map through its
    client's, refreshes it itself): per server its latest trusted check; each of ``adapters`` gets ``audits``."""
    from swarm.reports.records import adapter_audits_json, audit_json

    for adapter in adapters:
        adapter["audits"] = adapter_audits_json(book, adapter["sha256"])
        for version in adapter.get("versions", ()):  # each version's trusted scores: the curve of the name
            version["audits"] = adapter_audits_json(book, version["sha256"])
    latest = book.latest()
    return {peer: audit_json(latest, peer) for peer in sorted(latest)}


MAX_PROBED_SERVERS = 64  # servers one map asks (rpc_info) whether they answer, and for their usage counts
PROBE_TIMEOUT = 3.0  # seconds a server has to answer the map's probe (a dead one is refused at once)


def probe_online(caller: RemoteCaller, servers: Iterable[ServerRecord], timeout: float = PROBE_TIMEOUT
                 ) -> dict[str, Any]:
    """Ask each ONLINE server (at most ``MAX_PROBED_SERVERS``, all at once) for its ``rpc_info`` through ``caller``,
    dialling its announced addresses as a client does: per peer id its :class:`~swarm.health.probe.InfoReply`."""
    from swarm.health.probe import ask_all
    from swarm.utils.event_loop import BackgroundLoop

    online = [record for record in servers if record.state == ServerState.ONLINE][:MAX_PROBED_SERVERS]
    if not online:
        return {}
    return BackgroundLoop.shared().run(ask_all(caller, online, timeout), timeout=3 * timeout + 5)


def read_health_map(dht: DHT, prefix: str, num_blocks: int, adapters: bool = False,
                    auditors: Iterable[str] = (), usage: bool = False,
                    probe_with: Optional[RemoteCaller] = None, coordinators: Iterable[str] = ()) -> HealthMap:
    """Read every server record of the model and the expert index from the DHT (two batched reads); with
    ``adapters``, the published adapters too; with ``auditors``, each server's latest check by one of them. With
    ``probe_with`` (a caller over ``dht``'s daemon, kept by its owner: closing one connection to a hivemind daemon
    ends the calls of every other), ask each online server whether it answers, as a client does: those that do not
    are "unreachable" and not counted; with ``usage`` too, what each says it computed for its callers. With
    ``coordinators`` (base64 keys), the domain streams of their signed records (``swarm.improve.stream_records``)."""
    from swarm.health.probe import usage_of

    servers = read_servers(dht, prefix, num_blocks)
    experts = read_experts(dht, prefix)
    logger.debug("health map of %s: %d servers, %d expert domains", prefix, len(servers), len(experts))
    health = build_health_map(servers, prefix, num_blocks, experts)
    health.adapters = read_adapters(dht, prefix) if adapters else []
    auditors = list(auditors)
    health.audits = read_audits(dht, prefix, auditors, health.adapters) if auditors else {}
    coordinators = list(coordinators)
    if coordinators:
        from swarm.improve.stream_records import read_trusted_streams

        health.streams = read_trusted_streams(dht, prefix, coordinators)
    if probe_with is not None:
        replies = probe_online(probe_with, health.servers)
        asked_at = time.time()
        health.mark_unreachable({peer: asked_at for peer, reply in replies.items() if reply.error is not None})
        health.usage = {peer: usage_of(reply.info) for peer, reply in replies.items()} if usage else None
    return health
