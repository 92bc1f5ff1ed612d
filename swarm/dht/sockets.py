"""Socket files that hivemind leaves in /tmp when a peer dies without its own shutdown.

hivemind names two Unix sockets per peer, ``/tmp/hivemind-p2pd-ID.sock`` (its libp2p daemon's control socket) and
``/tmp/hivemind-p2pclient-ID.sock`` (where the daemon calls the peer back, once it serves streams), and removes them
only in its own shutdown. A server stopped with SIGKILL, or a DHT process or daemon that dies with its parent
(``swarm.dht.node``), leaves them behind: a run of the test suite left about 250, and a machine whose servers are
killed gathers them for good (19,977 in this project's /tmp on 2026-12-06).

:func:`remove_dead_sockets` removes this user's pairs whose daemon is gone: a daemon socket that nobody listens on
(``connect`` refused), with the peer's socket of the same ID. Liveness is asked of the daemon's socket only: a
connection that p2pd accepts and sees closed is silent there, whereas the peer's own socket logs a traceback for it.
A peer's socket without its daemon's stays: a P2P replica (``P2P.replicate``: a server's streams are served there)
names its socket with an ID of its own, so nothing tells from the name whether its daemon still runs. Files younger
than ``MIN_AGE_S`` are left alone, so a peer starting now is never touched. ``start_dht`` runs it before starting a
daemon, at most once every ``PERIOD_S`` on a machine (a marker file's age says when it last ran).
"""
from __future__ import annotations

import logging
import os
import re
import socket
import stat
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SOCKET_DIRECTORY = Path("/tmp")  # hivemind's P2P._UNIX_SOCKET_PREFIX, fixed there
SOCKET_NAME = re.compile(r"hivemind-(p2pd|p2pclient)-(.+)\.sock")
MIN_AGE_S = 60.0
PERIOD_S = 600.0


def _listening(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket ``path`` (a refused connect: nobody does)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:  # a full backlog, a timeout, no permission: someone may be there
            return True
        return True


def remove_dead_sockets(directory: Path = SOCKET_DIRECTORY, min_age: float = MIN_AGE_S) -> int:
    """Remove this user's hivemind socket files (a daemon's, and the peer's of the same ID) whose daemon socket
    nobody listens on; how many."""
    now, uid = time.time(), os.getuid()
    pairs: dict[str, dict[str, str]] = {}
    try:
        entries = list(os.scandir(directory))
    except OSError as error:
        logger.debug("cannot list %s: %s", directory, error)
        return 0
    for entry in entries:
        match = SOCKET_NAME.fullmatch(entry.name)
        if match is None:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISSOCK(info.st_mode) and info.st_uid == uid and now - info.st_mtime >= min_age:
            pairs.setdefault(match.group(2), {})[match.group(1)] = entry.path
    removed = 0
    for files in pairs.values():
        if "p2pd" not in files or _listening(files["p2pd"]):
            continue  # a live daemon, or a replica's socket (its daemon's ID is not in its name)
        for path in files.values():
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
    if removed:
        logger.info("removed %d socket files of hivemind peers that are gone, in %s", removed, directory)
    return removed


def remove_dead_sockets_now_and_then(directory: Path = SOCKET_DIRECTORY, period: float = PERIOD_S) -> int:
    """:func:`remove_dead_sockets`, unless this user ran it in ``directory`` less than ``period`` seconds ago."""
    marker = Path(directory) / f"swarm-socket-janitor-{os.getuid()}"
    try:
        if time.time() - marker.stat().st_mtime < period:
            return 0
    except OSError:
        pass
    try:
        marker.touch()  # first: the peers starting beside this one skip the scan
    except OSError:
        return 0
    return remove_dead_sockets(directory)
