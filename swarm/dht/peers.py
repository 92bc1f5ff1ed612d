"""Where initial peers come from: command line, ``SWARM_INITIAL_PEERS``, and a bootstrap-list file.

The bootstrap list is a text file with one multiaddr per line (``#`` starts a comment). The package ships
``swarm/bootstrap_peers.txt`` (empty until a public swarm publishes its peers); ``SWARM_BOOTSTRAP_FILE``
points to another file. Operators of a public swarm publish theirs by editing that file.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Optional

from multiaddr import Multiaddr

from swarm.utils.errors import EXIT_UNREACHABLE, SwarmError

logger = logging.getLogger(__name__)

ENV_PEERS = "SWARM_INITIAL_PEERS"
ENV_BOOTSTRAP_FILE = "SWARM_BOOTSTRAP_FILE"
PACKAGED_BOOTSTRAP_FILE = Path(__file__).resolve().parent.parent / "bootstrap_peers.txt"


def read_bootstrap_file(path: Path) -> list[str]:
    if not path.exists():
        return []
    peers = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            peers.append(line)
    return peers


# As docs write a server's (or a keyed bootstrap peer's) address: their RSA identities have Qm... ids.
PEER_EXAMPLE = "/ip4/203.0.113.5/tcp/31337/p2p/Qm..."


def check_peer_multiaddr(text: str, source: str = "--initial-peers") -> str:
    """``text`` if it is a multiaddr hivemind can dial: a transport address, then ``/p2p/<peer id>``.

    Checked before any daemon starts, so that ``127.0.0.1:31337`` gets one line naming the flag instead of a
    daemon's parse error, and a peer id that is no peer id (a character lost in a copy) gets one line at once instead
    of a dial that times out. Whether the peer at that address has that id is for libp2p to find (it cannot join).
    """
    transport, separator, peer_id = text.partition("/p2p/")
    if not text.startswith("/") or not separator or not peer_id:
        raise ValueError(f"{source}: {text!r} is not a peer's multiaddr; expected {PEER_EXAMPLE}, as printed by "
                         "the bootstrap peer or a server")
    try:
        Multiaddr(transport)
    except ValueError as error:
        reason = str(error).split(":", 1)[-1].split(" (string:", 1)[0].strip()
        raise ValueError(f"{source}: {text!r} is not a valid multiaddr ({reason}); expected {PEER_EXAMPLE}") from None
    check_peer_id(peer_id, f"{source}: {peer_id!r} in {text!r}")
    return text


def check_peer_id(peer_id: str, source: str) -> str:
    """``peer_id`` if it is one (base58 of a multihash of the right length); a ValueError naming ``source``."""
    try:
        Multiaddr(f"/p2p/{peer_id}")
    except (ValueError, TypeError):
        raise ValueError(f"{source} is not a peer id (a peer id is base58, 46 characters from Qm or 52 from "
                         "12D3KooW, as printed by the bootstrap peer or a server: copy it whole)") from None
    return peer_id


def peer_id_problem(peer_ids: Iterable[str], flag: str) -> Optional[str]:
    """What is wrong with the first of ``peer_ids`` that is no peer id (named as ``flag VALUE``), or None: for a
    config's check of a list of peer ids given by a user."""
    for peer in peer_ids:
        try:
            check_peer_id(peer, f"{flag} {str(peer)[:80]!r}")
        except ValueError as error:
            return str(error)
    return None


def split_peers(texts: Iterable[str] | str, source: str) -> list[str]:
    """Multiaddrs separated by spaces or commas, each checked; one string is one text, not its characters."""
    if isinstance(texts, str):
        texts = [texts]
    return [check_peer_multiaddr(p, source) for text in texts for p in text.replace(",", " ").split() if p]


class NoInitialPeers(SwarmError, ValueError):
    """A client was given no peer to join through, and neither the environment nor the bootstrap file has one."""

    exit_code = EXIT_UNREACHABLE


def require_initial_peers(explicit: Optional[Iterable[str] | str], use_defaults: bool = True,
                          how: str = "initial_peers=[...]") -> list[str]:
    """The peers a client joins through (:func:`resolve_initial_peers`); none is :class:`NoInitialPeers` at once, in
    one line saying where peers come from (``how``: the argument or flag to name), instead of a wait for servers
    that cannot be found."""
    peers = resolve_initial_peers(explicit, use_defaults)
    if not peers:
        raise NoInitialPeers(
            f"no initial peers: pass {how} with the address a server or python -m swarm.dht printed, or set "
            f"${ENV_PEERS}, or list them in a bootstrap file (${ENV_BOOTSTRAP_FILE}; the packaged one is empty); "
            "swarm.DiffusionLM runs the model in this process without a swarm")
    return peers


def resolve_initial_peers(explicit: Optional[Iterable[str] | str] = None, use_defaults: bool = True) -> list[str]:
    """Explicit peers win; otherwise the environment; otherwise the bootstrap file. Order kept, no duplicates.

    Every multiaddr is checked (:func:`check_peer_multiaddr`): a ValueError names where a bad one came from.
    """
    peers = split_peers(explicit or (), "--initial-peers")
    if not peers and use_defaults:
        peers = split_peers([os.environ.get(ENV_PEERS, "")], f"${ENV_PEERS}")
        if peers:
            logger.info("initial peers from $%s", ENV_PEERS)
    if not peers and use_defaults:
        path = Path(os.environ.get(ENV_BOOTSTRAP_FILE, PACKAGED_BOOTSTRAP_FILE))
        peers = split_peers(read_bootstrap_file(path), str(path))
        if peers:
            logger.info("initial peers from %s", path)
    return list(dict.fromkeys(peers))
