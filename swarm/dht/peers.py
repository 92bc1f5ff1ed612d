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


def resolve_initial_peers(explicit: Optional[Iterable[str]] = None, use_defaults: bool = True) -> list[str]:
    """Explicit peers win; otherwise the environment; otherwise the bootstrap file. Order kept, no duplicates."""
    peers: list[str] = []
    for peer in explicit or ():
        peers.extend(p for p in peer.replace(",", " ").split() if p)
    if not peers and use_defaults:
        env = os.environ.get(ENV_PEERS, "")
        peers = [p for p in env.replace(",", " ").split() if p]
        if peers:
            logger.info("initial peers from $%s", ENV_PEERS)
    if not peers and use_defaults:
        path = Path(os.environ.get(ENV_BOOTSTRAP_FILE, PACKAGED_BOOTSTRAP_FILE))
        peers = read_bootstrap_file(path)
        if peers:
            logger.info("initial peers from %s", path)
    return list(dict.fromkeys(peers))
