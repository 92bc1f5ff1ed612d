"""How clients reach a server, read from the addresses it announces (``ServerRecord.addresses``).

Only the server's key writes its record, so its addresses are its own word (see ``swarm/dht/schema.py``). A
public address means clients dial it directly; ``/p2p-circuit`` addresses only means it sits behind NAT and is
reached through a relay first (hole punching may then open a direct connection: ``docs/OPERATIONS.md``, "Behind
NAT"); private addresses only (LAN, loopback) mean that only its own network reaches it.
"""
from __future__ import annotations

from typing import Iterable

from swarm.dht.nat import address_kind

DIRECT, RELAY, LOCAL, UNKNOWN = "direct", "relay", "local", "unknown"
MEANING = {
    DIRECT: "announces a public address: clients dial it directly",
    RELAY: "behind NAT: reached through a relay (then directly if hole punching succeeds)",
    LOCAL: "announces only LAN or loopback addresses: reachable from its own network only",
    UNKNOWN: "announces no address (an older server)",
}


def reachability(addresses: Iterable[str]) -> str:
    """``direct``, ``relay``, ``local`` or ``unknown`` for a server announcing ``addresses``."""
    kinds = {address_kind(address) for address in addresses}
    if "public" in kinds:
        return DIRECT
    if "relay" in kinds:
        return RELAY
    return LOCAL if kinds else UNKNOWN
