"""How a process joins the swarm (:class:`NetworkConfig`): plain data, importing no network library, so that the
server's and the client's settings (and their ``--help``) load without hivemind."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
# How far ahead a server or expert record may expire on the peers that store it (``swarm.dht.schema``), so that a
# squatter's records leave within the hour; a server announces every ``update_period`` (at most
# MAX_UPDATE_PERIOD) for 2.5 periods, which stays inside it.
MAX_OWNED_LIFETIME = 3600.0
MAX_UPDATE_PERIOD = 600.0
MAX_AUDIT_LIFETIME = 24 * 3600.0  # an auditor's report lives at most a day: one that stopped is forgotten
# No model has more blocks; spans beyond are malformed (``swarm.dht.schema``). Here so that ``--num-blocks`` of
# ``python -m swarm.dht`` is declared without loading hivemind.
MAX_BLOCKS = 100_000
MAX_PEER_ID_CHARS = 128  # a peer id named in a record (base58 libp2p ids are 46-53 characters)


def as_peer_list(peers: "str | list[str] | tuple[str, ...] | None") -> list[str]:
    """A list of peer multiaddrs from what users type: one string (possibly several addresses separated by spaces
    or commas, as in ``$SWARM_INITIAL_PEERS``) or any sequence of them (each checked later, where they are used)."""
    if peers is None:
        return []
    if isinstance(peers, str):
        return peers.replace(",", " ").split()
    return list(peers)


@dataclass
class NetworkConfig:
    """How a process joins the swarm; the defaults suit one machine (loopback only).

    ``initial_peers`` may be given as one string, as Hugging Face and Petals users write it: it becomes a list.
    """

    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: list(LOOPBACK_MADDRS))
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: Optional[str] = None
    # Circuit relays, to reach and be reached from behind NAT; None: on, but in a swarm on this machine only, where
    # they cannot help (swarm.dht.nat.relay_wanted)
    use_relay: Optional[bool] = None
    use_auto_relay: bool = False
    client_mode: bool = False
    use_default_peers: bool = True  # fall back to $SWARM_INITIAL_PEERS and the bootstrap file
    # Behind NAT (detected, swarm.dht.nat): seconds to wait for a relay reservation before going on unreachable
    relay_wait: float = 20.0

    def __post_init__(self) -> None:
        self.initial_peers = as_peer_list(self.initial_peers)
        self.host_maddrs = as_peer_list(self.host_maddrs)
        self.announce_maddrs = as_peer_list(self.announce_maddrs)
