"""The health map as text for a terminal: a server table, replica runs and the verdict."""
from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from swarm.client.config import DEFAULT_OVERCLAIM_FACTOR
from swarm.health.map import HealthMap, format_spans
from swarm.health.reachability import reachability
from swarm.utils.text import plural


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns, two spaces apart; the last column is not padded."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for row in [headers, *rows]:
        cells = [str(cell).ljust(width) for cell, width in zip(row[:-1], widths)] + [str(row[-1])]
        lines.append("  ".join(cells).rstrip())
    return lines


def audit_cell(audit: Optional[dict[str, Any]]) -> str:
    """A server's latest trusted audit in a few words: ``pass 3/3 at 14:05 (measured 812 tok/s)``, ``FAIL 1/2 ...``
    (the TOK/S column beside it is what the server announces), and ``OVERCLAIMS 10.0x`` when that announcement is
    over the clients' default ``overclaim_factor`` times what the auditor calibrated."""
    if audit is None:
        return "-"
    checks = audit["passed"] + audit["failed"] + audit["errors"]
    verdict = audit["verdict"] if audit["verdict"] == "pass" else audit["verdict"].upper()
    measured = "" if audit["measured"] is None else f" (measured {audit['measured']:.0f} tok/s)"
    when = time.strftime("%H:%M", time.gmtime(audit["last_check"]))
    overclaim = audit.get("overclaim")
    claims = f", OVERCLAIMS {overclaim:.1f}x" if overclaim is not None and overclaim > DEFAULT_OVERCLAIM_FACTOR else ""
    return f"{verdict} {audit['passed']}/{checks} at {when}{measured}{claims}"


def usage_lines(health: HealthMap) -> list[str]:
    """``--usage``: per online server, what it says it computed (tokens = rows x blocks), for how many callers, its
    share cap and its heaviest caller."""
    rows = []
    for record in health.servers:
        if record.peer_id not in health.usage:
            continue
        usage = health.usage[record.peer_id]
        if usage is None:
            rows.append((f"{record.start}:{record.end}", "no answer", "-", "-", "-", "-", "-", record.peer_id))
            continue
        total, callers = usage["total"], usage["callers"]
        cap = "none" if usage["max_share"] >= 1 else f"{usage['max_share']:.0%} of {usage['window_s']:.0f} s"
        top = "-"
        if callers and total["tokens"]:
            heaviest = callers[0]
            top = f"...{heaviest['peer_id'][-8:]} {heaviest['tokens'] / total['tokens']:.0%}"
        rows.append((f"{record.start}:{record.end}", f"{total['tokens']:,}", f"{total['seconds']:.1f}",
                     f"{total['requests']:,}", str(usage["callers_tracked"] + usage["callers_forgotten"]),
                     f"{cap}, {usage['refused']} refused", top, record.peer_id))
    if not rows:
        return ["USAGE: no online server to ask."]
    return format_table(("BLOCKS", "TOKENS", "SECONDS", "REQUESTS", "CALLERS", "SHARE CAP", "TOP CALLER",
                         "PEER ID"), rows)


def stream_lines(streams: Sequence[dict[str, Any]]) -> list[str]:
    """The trusted coordinators' streams: weight, pool size, the audited curve, stalled, and what a reader flags."""
    rows = [(s["stream"], s["task"], f"{s['weight']:g}", str(len(s["pool"])),
             " ".join(f"{score:.2f}" for score in s["curve"][-6:]) or "-", "STALLED" if s["stalled"] else "live",
             "; ".join(s["flags"]) or "-", s["coordinator"][:12]) for s in streams]
    return format_table(("STREAM", "TASK", "WEIGHT", "POOL", "CURVE", "STATE", "FLAGS", "COORDINATOR"), rows)


def state_cell(health: HealthMap, peer_id: str, state: str) -> str:
    """The announced state, or ``unreachable since 12:04:05 UTC`` for a server that did not answer the map's probe."""
    since = health.unreachable.get(peer_id)
    return state if since is None else f"unreachable since {time.strftime('%H:%M:%S', time.gmtime(since))} UTC"


def render_text(health: HealthMap) -> str:
    announced = f"{plural(health.num_blocks, 'block')}, {plural(len(health.servers), 'server')} announced"
    lines = [f"Model {health.prefix!r}: {announced}", ""]
    if health.servers:
        rows = [
            (f"{r.start}:{r.end}" + (" +head" if r.head else ""), state_cell(health, r.peer_id, r.state.name.lower()),
             f"{r.throughput:.1f}",
             r.version or "?",
             r.public_name or "-", "exact" if not r.approximate else f"APPROXIMATE ({r.numerics})",
             reachability(r.addresses), ",".join(r.adapter_kinds) or "-", audit_cell(health.audits.get(r.peer_id)),
             r.peer_id)
            for r in health.servers
        ]
        lines += format_table(("BLOCKS", "STATE", "TOK/S", "VERSION", "NAME", "NUMERICS", "REACH", "ADAPTERS",
                               "AUDIT", "PEER ID"), rows)
    else:
        lines.append("No server has announced any block of this model (check --initial-peers and the prefix).")
    if health.usage is not None:
        lines += [""] + usage_lines(health)
    lines.append("")
    runs = [(f"{start}:{end}", str(count)) for (start, end), count in health.replica_runs()]
    lines += format_table(("BLOCKS", "ONLINE REPLICAS"), runs)
    for domain, announcements in health.experts.items():
        lines.append(f"Expert {domain!r}: {plural(len(announcements), 'peer')}")
    if health.adapters:
        lines.append("")
        rows = [(f"{a['name']}@{a['author']}", f"{a['size']}", "-" if a["score"] is None else f"{a['score']:g}",
                 ", ".join(f"{task} {s['correct']}/{s['examples']}" for task, s in a.get("audits", {}).items()) or "-",
                 str(len(a["hosts"])), a["sha256"][:16]) for a in health.adapters]
        lines += format_table(("ADAPTER", "BYTES", "CLAIMED", "AUDITED", "HOSTS", "SHA256"), rows)
    if health.streams:
        lines += [""] + stream_lines(health.streams)
    lines.append("")
    if health.fully_served:
        fewest = plural(min(health.replicas), "replica")
        lines.append(f"OK: every block is served by at least one online server (min {fewest}).")
    else:
        lines.append(f"NOT FULLY SERVED: no online server holds blocks {format_spans(health.uncovered)}.")
    if health.unreachable:
        lines.append(f"{plural(len(health.unreachable), 'server')} announced online did not answer: not counted.")
    return "\n".join(lines)
