"""Behind NAT: is this peer reachable only through relays, and the daemon options that make it so quickly.

hivemind's libp2p daemon can reserve a slot on a circuit relay and announce ``/p2p-circuit`` addresses, and its
hole punching (DCUtR) can upgrade a relayed connection to a direct one. Left to itself it is slow to start: AutoNAT
needs about 15 s to conclude that the peer is private, and autorelay then waits 3 minutes unless it already knows
4 relay candidates (measured in the NAT lab, docs/OPERATIONS.md, "Behind NAT"). A peer that knows it is behind NAT
skips both waits: it forces reachability "private" and names the swarm's public initial peers as trusted relays.

Whether a peer is behind NAT is decided locally, before its daemon starts (:func:`relay_plan`): it is when the
address this machine uses to reach a public initial peer is a private one, or when it listens on loopback only.
The same address classification tells, from the addresses a server announces, how others reach it
(:func:`address_kind`; ``python -m swarm.health`` shows it).
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

logger = logging.getLogger(__name__)

RELAY_MARKER = "/p2p-circuit"
ALL_INTERFACES = ("/ip4/0.0.0.0/tcp/0",)
# libp2p's own idea of "not public" (go-multiaddr's manet.Private4/6 and Unroutable4/6): AutoNAT and hole punching
# ignore these, so they decide what counts as a public address here too.
_NOT_PUBLIC = [ipaddress.ip_network(net) for net in (
    "127.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16",
    "0.0.0.0/8", "192.0.0.0/26", "192.0.2.0/24", "192.88.99.0/24", "198.18.0.0/15", "198.51.100.0/24",
    "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4", "255.255.255.255/32",
    "::1/128", "fc00::/7", "fe80::/10", "ff00::/8", "2001:db8::/32", "::/128",
)]


def is_public_ip(host: str) -> bool:
    """Whether libp2p would treat ``host`` as a public address (False for anything that is not an IP)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return not any(ip in net for net in _NOT_PUBLIC if net.version == ip.version)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def address_host(maddr: str) -> tuple[str, str]:
    """(protocol, value) of a multiaddr's first component: ``("ip4", "1.2.3.4")``, ``("dns", "example.org")``."""
    parts = str(maddr).split("/")
    return (parts[1], parts[2]) if len(parts) > 2 else ("", "")


def address_kind(maddr: str) -> str:
    """``relay`` (a ``/p2p-circuit`` address), ``public``, ``private`` (LAN, loopback) for one multiaddr."""
    if RELAY_MARKER in str(maddr):
        return "relay"
    protocol, host = address_host(maddr)
    if protocol in ("dns", "dns4", "dns6", "dnsaddr"):
        return "private" if host == "localhost" or host.endswith((".local", ".localhost")) else "public"
    return "public" if is_public_ip(host) else "private"


def public_peers(peers: Iterable[str]) -> list[str]:
    """Initial peers at public addresses with a ``/p2p/`` peer id: the relays a NATed peer may use."""
    return [p for p in peers if "/p2p/" in p and RELAY_MARKER not in p and address_kind(p) == "public"]


def on_one_machine(host_maddrs: Iterable[str], peers: Iterable[str]) -> bool:
    """Whether a peer that listens on ``host_maddrs`` and joins ``peers`` is in a swarm on this machine only: it
    listens on loopback alone (no other machine can dial it) and every initial peer is on loopback."""
    hosts = [address_host(m) for m in host_maddrs] + [address_host(p) for p in peers]
    return bool(host_maddrs) and all(
        _is_loopback(host) or (protocol in ("dns", "dns4", "dns6") and host == "localhost") for protocol, host in hosts)


def relay_wanted(use_relay: Optional[bool], host_maddrs: Iterable[str], peers: Iterable[str]) -> bool:
    """``use_relay`` as given, or when it is None (the default) whether a circuit relay can help this peer at all:
    not in a swarm on one machine (:func:`on_one_machine`), where no peer is behind a NAT. There the relay only cost:
    each libp2p daemon builds an IP-to-ASN table for its relay service at start, about 0.25 of its 0.4 CPU s in a
    swarm's first seconds (docs/TESTING-HISTORY.md, "The libp2p daemon's relay")."""
    if use_relay is not None:
        return use_relay
    host_maddrs, peers = list(host_maddrs), list(peers)
    if on_one_machine(host_maddrs, peers):
        logger.debug("a swarm on this machine only (loopback): no circuit relay (--use-relay turns it on)")
        return False
    return True


def listen_addresses(host_maddrs: Iterable[str], default: Iterable[str], peers: Iterable[str]) -> list[str]:
    """Where to listen: the loopback default follows the swarm, so a peer joining public peers listens on every
    interface (a free port): others can dial it, or, behind NAT, hole punching can open a direct connection."""
    if list(host_maddrs) == list(default) and public_peers(peers):
        logger.info("the initial peers are public: listening on %s instead of loopback", ", ".join(ALL_INTERFACES))
        return list(ALL_INTERFACES)
    return list(host_maddrs)


def source_address(host: str) -> Optional[str]:
    """The local address this machine uses to reach ``host`` (a routing lookup: a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError as error:
        logger.debug("no route to %s: %s", host, error)
        return None


def nat_reason(host_maddrs: Iterable[str], relays: list[str]) -> Optional[str]:
    """Why a peer that wants to reach ``relays`` (public peers) cannot be dialed directly, or None."""
    if not relays:
        return None  # a LAN or single-machine swarm: nobody needs a relay
    listen = [address_host(m) for m in host_maddrs]
    if any(is_public_ip(host) for _, host in listen):
        return None  # it listens on a public address of its own
    if listen and all(_is_loopback(host) for _, host in listen):
        return "it listens on loopback only (--host-maddrs), so no other machine can dial it"
    for relay in relays:
        protocol, host = address_host(relay)
        if protocol not in ("ip4", "ip6"):
            continue
        local = source_address(host)
        if local is not None:
            return None if is_public_ip(local) else f"it reaches the public peer {host} from private address {local}"
    return None


@dataclass
class RelayPlan:
    """How a peer that others cannot dial becomes reachable: reservations on ``relays`` (its public initial peers)."""

    reason: str
    relays: list[str]
    detected: bool  # behind NAT by :func:`nat_reason` (else only asked for with --use-auto-relay)

    def daemon_options(self) -> dict[str, Any]:
        """hivemind ``DHT``/``P2P`` keyword arguments. A detected NAT skips AutoNAT's wait ("private" is known) and
        makes the DHT peer a client (DHT requests relayed to it would be slow for everyone)."""
        options: dict[str, Any] = dict(use_relay=True, use_auto_relay=True)
        if self.relays:
            options["trusted_relays"] = list(self.relays)
        if self.detected:
            options.update(force_reachability="private", client_mode=True)
        return options


def relay_plan(host_maddrs: Iterable[str], announce_maddrs: Iterable[str], peers: Iterable[str], *,
               use_relay: bool, use_auto_relay: bool, client_mode: bool) -> Optional[RelayPlan]:
    """The relay setup a peer needs, or None (reachable directly, a client, or announced by hand).

    Clients only dial out, so they need no reservation; ``announce_maddrs`` says the operator made the peer
    reachable (port forwarding); ``use_relay=False`` leaves a NATed peer unreachable, with a warning.
    """
    relays = public_peers(peers)
    if client_mode or list(announce_maddrs):
        return None
    reason = nat_reason(host_maddrs, relays)
    if reason and not use_relay:
        logger.warning("this peer cannot be dialed (%s) and --no-relay forbids relays: nobody can reach it", reason)
        return None
    if reason:
        return RelayPlan(reason, relays, detected=True)
    if use_auto_relay:
        return RelayPlan("--use-auto-relay", relays, detected=False)
    return None


def relay_addresses(maddrs: Iterable[Any]) -> list[str]:
    return [str(m) for m in maddrs if RELAY_MARKER in str(m)]


def wait_for_relay(visible_maddrs, timeout: float, poll: float = 0.25) -> tuple[list[str], float]:
    """Poll ``visible_maddrs()`` until it lists a relay address (or ``timeout`` passes): (addresses, seconds)."""
    started = time.monotonic()
    while True:
        found = relay_addresses(visible_maddrs())
        waited = time.monotonic() - started
        if found or waited >= timeout:
            return found, waited
        time.sleep(poll)
