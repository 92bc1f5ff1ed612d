"""What the swarm map page shows, as plain JSON: the health map plus what this peer sees of each server.

Pure functions, no network, so the arithmetic and the sanitising are testable on their own. Everything a
server announces is remote input: strings are cut, non-finite numbers become null (a ``NaN`` throughput would
otherwise make the whole document invalid JSON) and only the fields the page draws are passed on. The page
still writes every string with ``textContent``, never as HTML.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from swarm.client.config import DEFAULT_OVERCLAIM_FACTOR
from swarm.dht.schema import ExpertRecord
from swarm.health.map import ExpertAnnouncement, HealthMap, server_json
from swarm.reports.records import FAIL

MAX_TEXT = 120  # characters kept of any announced string (names, versions, numerics)
MAX_ITEMS = 32  # items kept of any announced list (a server's experts)
MAX_EXPERT_PEERS = 64  # announcements shown per expert domain
MAX_DOMAINS = 64  # expert domains shown
MAX_ADAPTERS = 64  # published adapters shown

# The colour of a server's bar: the first status that applies, in this order.
STATUSES = ("offline", "joining", "banned", "busy", "online")


@dataclass(frozen=True)
class Probe:
    """One ``rpc_info`` round trip from this peer to a server (None fields: not measured)."""

    rtt_ms: Optional[float] = None
    in_flight: Optional[int] = None  # requests the server is computing or queueing now
    error: Optional[str] = None  # why it did not answer
    usage: Optional[dict[str, Any]] = None  # what it says it computed for its callers (``parse_usage``'s map)


@dataclass(frozen=True)
class ClientView:
    """What the local client knows of the servers (empty when the page is served without a client)."""

    banned: frozenset[str] = frozenset()  # avoided by this client right now (failed, busy back-off, disputed)
    distrusted: frozenset[str] = frozenset()  # caught returning wrong results: never used again
    route: tuple[str, ...] = ()  # the client's current route, hop by hop (``peer[start:end]``)
    route_peers: frozenset[str] = frozenset()


def text(value: Any, limit: int = MAX_TEXT) -> Optional[str]:
    """A remote string, cut to ``limit`` characters; anything that is not a string becomes None."""
    return value[:limit] if isinstance(value, str) else None


def number(value: Any) -> Optional[float]:
    """A finite number or None (JSON has no NaN or infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def status_of(state: str, banned: bool, probe: Optional[Probe]) -> str:
    """The bar's colour (see :data:`STATUSES`); approximate numerics are drawn as stripes on top of it."""
    if state in ("offline", "joining"):
        return state
    if banned:
        return "banned"
    if probe is not None and probe.in_flight:
        return "busy"
    return "online"


def usage_view(usage: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """A server's usage totals as the table shows them (its own word, unchecked), from ``parse_usage``'s map."""
    if usage is None:
        return None
    total = usage["total"]
    return {"tokens": total["tokens"], "seconds": number(total["seconds"]), "requests": total["requests"],
            "refused": usage["refused"]}


def server_view(record: dict[str, Any], probe: Optional[Probe], client: ClientView,
                audit: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One server row: the announced fields (sanitised), then what this peer measured and decided, and its latest
    check by a trusted auditor (``audit``: ``swarm.health --json``'s, parsed from a signed report)."""
    peer = str(record["peer_id"])
    banned = peer in client.banned or peer in client.distrusted
    return {
        "peer_id": peer, "public_name": text(record.get("public_name")),
        "start": int(record["start"]), "end": int(record["end"]), "state": str(record["state"]),
        "throughput": number(record.get("throughput")), "version": text(record.get("version"), 40),
        "cache_tokens_left": number(record.get("cache_tokens_left")),
        "experts": [item for item in map(text, list(record.get("experts") or [])[:MAX_ITEMS]) if item],
        "numerics": text(record.get("numerics")), "approximate": bool(record.get("approximate")),
        "adapter_kinds": [item for item in map(text, list(record.get("adapter_kinds") or [])[:MAX_ITEMS]) if item],
        "status": status_of(str(record["state"]), banned, probe),
        "rtt_ms": None if probe is None else number(probe.rtt_ms),
        "in_flight": None if probe is None else probe.in_flight,
        "probe_error": None if probe is None else text(probe.error, 200),
        "banned": peer in client.banned, "distrusted": peer in client.distrusted,
        "in_route": peer in client.route_peers,
        "usage": None if probe is None else usage_view(probe.usage),
        "audit": audit, "audit_failed": audit is not None and audit.get("verdict") == FAIL,
        "audit_overclaims": overclaims(audit),
    }


def overclaims(audit: Optional[dict[str, Any]]) -> Optional[float]:
    """How many times its calibrated throughput the server announces, when over the clients' default
    ``overclaim_factor`` (clients route it by the calibration then); else None."""
    ratio = audit.get("overclaim") if audit is not None else None
    return number(ratio) if isinstance(ratio, (int, float)) and ratio > DEFAULT_OVERCLAIM_FACTOR else None


def adapter_view(adapter: dict[str, Any]) -> dict[str, Any]:
    """One published adapter (``read_adapters``' entry, a parsed signed record): who published it, the score its
    author claims and, per task, the latest score a trusted auditor measured of its content."""
    audits = {text(task, 40): {"correct": entry.get("correct"), "examples": entry.get("examples"),
                               "score": number(entry.get("score")), "checked": number(entry.get("checked")),
                               "auditor": text(entry.get("auditor"), 64)}
              for task, entry in sorted((adapter.get("audits") or {}).items())[:MAX_ITEMS]}
    return {"name": text(adapter.get("name")), "author": text(adapter.get("author"), 64),
            "sha256": text(adapter.get("sha256"), 64), "size": number(adapter.get("size")),
            "claimed": number(adapter.get("score")), "hosts": len(adapter.get("hosts") or ()), "audits": audits,
            "versions": [version_view(v) for v in list(adapter.get("versions") or ())[:MAX_ITEMS]
                         if isinstance(v, dict)]}


def version_view(version: dict[str, Any]) -> dict[str, Any]:
    """One version of a name (swarm.adapters.versions): its number, its publisher's own figure, whether withdrawn,
    and per task the latest trusted audited score: the points of the name's curve on the map."""
    audited = {text(task, 40): number(entry.get("score")) for task, entry
               in sorted((version.get("audits") or {}).items())[:MAX_ITEMS] if isinstance(entry, dict)}
    return {"number": number(version.get("number")), "claimed": number(version.get("score")),
            "withdrawn": version.get("withdrawn") is True, "sha256": text(version.get("sha256"), 64),
            "audited": audited}


def expert_view(domain: str, announcements: Iterable[ExpertAnnouncement]) -> dict[str, Any]:
    """One expert domain: its valid announcements with their compatibility tags; malformed ones are counted."""
    peers, malformed = [], 0
    for announcement in list(announcements)[:MAX_EXPERT_PEERS]:
        record = ExpertRecord.from_value(announcement.peer_id, announcement.value)
        if record is None or record.domain != domain:
            malformed += 1
            continue
        peers.append({"peer_id": record.peer_id, "model": text(record.model), "state": record.state.name.lower(),
                      "public_name": text(record.public_name), "version": text(record.version, 40),
                      "throughput": number(record.throughput),
                      "tag": {"tokenizer": text(record.tag.tokenizer, 40), "vocab_size": record.tag.vocab_size,
                              "mask_token_id": record.tag.mask_token_id}})
    return {"domain": text(domain), "peers": peers, "malformed": malformed}


def governance_view(enabled: bool, decision: Any = None, error: Optional[str] = None) -> dict[str, Any]:
    """The newest valid governance decision: halted or not, by which key, since when (Unix seconds)."""
    view: dict[str, Any] = {"enabled": enabled, "halted": False, "error": error}
    if decision is not None:
        view.update(halted=bool(decision.halted), action=decision.action, reason=text(decision.reason, 500),
                    signer=decision.signer, since=number(decision.timestamp), sequence=decision.sequence)
    return view


def stream_view(stream: dict[str, Any]) -> dict[str, Any]:
    """A trusted coordinator's stream (``StreamRecord.views``: parsed and bounded already): weight, pool, curve,
    stalled, and what the reader flags."""
    return {"stream": text(stream["stream"], 64), "task": text(stream["task"], 32), "weight": number(stream["weight"]),
            "pool": [text(node, 64) for node in stream["pool"]], "curve": [number(s) for s in stream["curve"]],
            "stalled": bool(stream["stalled"]), "flags": [text(flag) for flag in stream["flags"]],
            "coordinator": text(stream["coordinator"], 64)}


def map_snapshot(health: HealthMap, probes: dict[str, Probe], client: ClientView, governance: dict[str, Any],
                 source: str, playground: bool, auditors: Iterable[str] = ()) -> dict[str, Any]:
    """The document ``/map.json`` answers: everything the map page draws, JSON-safe. ``auditors``: the keys whose
    reports gave ``health.audits`` (none: the page says that no auditor is trusted, not that nobody was checked)."""
    servers = [server_view(server_json(record), probes.get(record.peer_id), client, health.audits.get(record.peer_id))
               for record in health.servers]
    domains = sorted(health.experts.items())[:MAX_DOMAINS]
    return {
        "mode": "swarm", "source": source, "playground": playground, "generated_at": time.time(),
        "model": text(health.prefix), "num_blocks": health.num_blocks, "fully_served": health.fully_served,
        "uncovered": [list(span) for span in health.uncovered], "replicas": list(health.replicas),
        "servers": servers, "route": list(client.route),
        "experts": [expert_view(domain, found) for domain, found in domains],
        "governance": governance, "auditors": sorted(auditors),
        "adapters": [adapter_view(adapter) for adapter in health.adapters[:MAX_ADAPTERS]],
        "streams": [stream_view(stream) for stream in health.streams[:MAX_ITEMS]],
    }


def local_snapshot(model: str) -> dict[str, Any]:
    """``/map.json`` of an API that runs the whole model in its own process: there is no swarm to draw."""
    return {"mode": "local", "source": "api", "playground": True, "generated_at": time.time(), "model": model,
            "num_blocks": 0, "fully_served": True, "uncovered": [], "replicas": [], "servers": [], "route": [],
            "experts": [], "governance": governance_view(False), "auditors": [], "adapters": [], "streams": []}
