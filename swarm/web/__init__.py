"""The web pages: a live swarm map and a playground that draws the denoising (docs/WEB.md).

Served by ``python -m swarm.api`` (both pages) and ``python -m swarm.health --serve`` (the map). FastAPI and uvicorn
come with ``pip install -e .`` (the api extra, ``pip install -e ".[api]"``, names the same), like the API; the pages
themselves are plain HTML, CSS and JS in ``swarm/web/static``.
"""
from swarm.web.routes import mount_api_pages, mount_pages
from swarm.web.watcher import SwarmWatcher, WatchConfig

__all__ = ["SwarmWatcher", "WatchConfig", "mount_api_pages", "mount_pages"]
