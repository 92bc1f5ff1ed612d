"""``python -m swarm.health --serve``: the live map alone, for operators who run no API."""
from __future__ import annotations

import logging
import signal
import socket
import threading
from typing import Any, Callable

from swarm.web.routes import mount_pages
from swarm.web.watcher import SwarmAccess, SwarmWatcher, WatchConfig

logger = logging.getLogger(__name__)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free port, so the address is known before the server starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def page_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/map"


def run_until_signal(server: Any, sock: socket.socket) -> None:
    """Run a uvicorn server until SIGINT / SIGTERM, then return normally.

    Once it has shut down, uvicorn raises again the signal that stopped it, under the handler that was there
    before it started: with the default one the process would die before its DHT peer is stopped. A handler
    that ignores it lets the caller clean up and exit with status 0.
    """
    if threading.current_thread() is not threading.main_thread():  # no signals to catch (tests)
        server.run(sockets=[sock])
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_map(access: SwarmAccess, sock: socket.socket, log_level: str, announce: Callable[[str], None],
              config: WatchConfig | None = None) -> None:
    """Serve the map of ``access`` on ``sock`` until SIGINT / SIGTERM, then close both; ``announce`` gets the
    page's URL once the app is ready."""
    import uvicorn
    from fastapi import FastAPI

    import swarm

    watcher = SwarmWatcher(access, source="health", playground=False, config=config or WatchConfig())
    try:
        app = FastAPI(title="diffusion-swarm map", version=swarm.__version__,
                      description="The live map of a swarm's servers and blocks.")
        mount_pages(app, watcher.snapshot, playground=False)
        announce(page_url(sock))
        run_until_signal(uvicorn.Server(uvicorn.Config(app, log_level=log_level.lower())), sock)
    finally:
        watcher.close()
        sock.close()
