"""Asking servers for their self-description (``rpc_info``): the one piece of code behind every map's pings.

``python -m swarm.health --usage`` reads each server's usage counts from it, the web map (``swarm.web.watcher``) its
round trip, load and usage counts. Both ask all servers at once, each bounded by a timeout, and dial a server's
announced addresses once when the first try fails (the daemon may only know an old address of a server that
restarted elsewhere). The answer is remote input: :func:`usage_of` parses its usage map, the web map its load.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from swarm.dht.schema import ServerRecord
from swarm.server.usage import parse_usage
from swarm.wire.remote import RemoteCaller

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InfoReply:
    """One server's ``rpc_info`` answer, or why there is none."""

    info: Any = None  # the decoded answer, unchecked (remote input)
    rtt: Optional[float] = None  # seconds the answer took
    error: Optional[str] = None  # why it did not answer (None when it did)


async def ask_info(caller: RemoteCaller, record: ServerRecord, timeout: float) -> InfoReply:
    """Ask one server; dial its announced addresses once if it cannot be reached (``RemoteCaller.dialing``). Never
    raises: any failure is something to show, not to stop the other servers' answers."""
    try:
        info, rtt = await caller.dialing(record.peer_id, record.addresses, timeout,
                                         lambda: caller.info(record.peer_id, timeout))
    except Exception as error:  # unreachable, refused, timed out
        logger.debug("no rpc_info from %s: %r", record.peer_id, error)
        return InfoReply(error=str(error) or type(error).__name__)
    return InfoReply(info, rtt)


async def ask_all(caller: RemoteCaller, records: Iterable[ServerRecord], timeout: float) -> dict[str, InfoReply]:
    """Ask every server of ``records`` at once (the callers choose and cap them): per peer id, its reply. Takes at
    most about three ``timeout``: a failed ask, a dial and a second ask."""
    records = list(records)
    replies = await asyncio.gather(*(ask_info(caller, record, timeout) for record in records))
    return {record.peer_id: reply for record, reply in zip(records, replies)}


def usage_of(info: Any) -> Optional[dict[str, Any]]:
    """The usage counts an ``rpc_info`` answer carries (``swarm.server.usage.parse_usage``), or None when it has
    none or they are malformed."""
    return parse_usage(info.get("usage")) if isinstance(info, dict) else None
