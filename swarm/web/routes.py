"""The routes of the pages: two static HTML pages, their JS/CSS, the map's JSON and the playground's settings.

The server side stays thin: the map page polls ``/map.json`` (a :class:`~swarm.web.watcher.SwarmWatcher`
snapshot), the playground posts to the API's own ``/v1/completions`` with ``stream: true`` and reads its
server-sent events. The pages are plain HTML, CSS and JS shipped in the package (no CDN, no build step).
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from swarm.diffusion.config import GenerationConfig, SettingField, settings_of
from swarm.frontend.lm import GenerationRequest
from swarm.web.snapshot import local_snapshot
from swarm.web.watcher import SwarmWatcher, client_access

logger = logging.getLogger(__name__)

STATIC = Path(__file__).with_name("static")
MAP_TIMEOUT_S = 30.0
# Only this origin's scripts, styles and requests: a server's announced name can never become markup that runs.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache",
}
# The playground's inputs, in the order of the form; each is a declared setting of generate().
PLAYGROUND_SETTINGS = ("gen_length", "steps", "block_length", "temperature", "remasking", "draft_steps", "staleness",
                       "cache", "cache_refresh_drift", "experts", "seed")


def setting_json(declared: SettingField) -> dict[str, Any]:
    """What the form needs of one declared setting: default, bounds or choices, and its help text."""
    spec = declared.spec
    kind = declared.kind if declared.kind in (int, float, str, bool) else None
    fixed = isinstance(declared.default, (int, float, str, bool)) and not spec.computed_default
    return {"name": declared.name, "kind": kind.__name__ if kind else "text", "help": declared.describe(),
            "default": declared.default if fixed else None,  # None: the form leaves it empty, the API fills it
            "choices": list(spec.choices), "low": spec.low,
            "high": spec.high if isinstance(spec.high, (int, float)) else None}


def playground_settings(model_defaults: Optional[Mapping[str, Any]] = None) -> list[dict[str, Any]]:
    """The form's inputs; ``model_defaults`` (the model's ``generation.json``) replace generate()'s defaults, so
    the form starts from the settings a request without them would get."""
    declared = {field.name: field for cls in (GenerationConfig, GenerationRequest) for field in settings_of(cls)}
    inputs = [setting_json(declared[name]) for name in PLAYGROUND_SETTINGS]
    for item in inputs:
        if model_defaults and item["name"] in model_defaults:
            item["default"] = model_defaults[item["name"]]
    return inputs


def page(name: str) -> FileResponse:
    return FileResponse(STATIC / name, media_type="text/html", headers=PAGE_HEADERS)


def mount_pages(app: FastAPI, map_source: Callable[[], dict[str, Any]], playground: bool,
                model_defaults: Optional[Mapping[str, Any]] = None) -> None:
    """Add ``/map``, ``/map.json`` and (with ``playground``) ``/playground`` to ``app``; ``/`` leads to the map.

    ``map_source`` is blocking (it may read the DHT): it runs in a worker thread, bounded by a timeout.
    """
    app.mount("/web/static", StaticFiles(directory=STATIC), name="web-static")

    @app.get("/", include_in_schema=False)
    async def index() -> RedirectResponse:
        return RedirectResponse("/map")

    @app.get("/map", include_in_schema=False)
    async def map_page() -> FileResponse:
        return page("map.html")

    @app.get("/map.json", summary="The live swarm map: servers, coverage, pings, governance")
    async def map_json() -> JSONResponse:
        try:
            snapshot = await asyncio.wait_for(asyncio.to_thread(map_source), MAP_TIMEOUT_S)
        except Exception as error:  # the page shows the message and keeps polling
            logger.warning("could not read the swarm map: %r", error)
            message = f"could not read the swarm map: {error or type(error).__name__}"
            return JSONResponse({"error": {"message": message, "type": "service_unavailable", "param": None,
                                           "code": None}}, status_code=503)
        return JSONResponse(snapshot, headers={"Cache-Control": "no-store"})

    if not playground:
        return

    @app.get("/playground", include_in_schema=False)
    async def playground_page() -> FileResponse:
        return page("playground.html")

    @app.get("/web/settings.json", summary="The playground's settings, as generate() declares them")
    async def settings_json() -> list[dict[str, Any]]:
        return playground_settings(model_defaults)


def mount_api_pages(app: FastAPI, engine: Any) -> None:
    """The pages of ``python -m swarm.api``: the map read through the engine's client, and the playground.

    ``engine`` is the API's :class:`~swarm.api.engine.GenerationEngine`; a local one has no swarm to map.
    """
    if engine.mode == "swarm":
        source = SwarmWatcher(client_access(engine.lm), source="api", playground=True).snapshot
    else:
        def source() -> dict[str, Any]:
            return local_snapshot(engine.model_id)
    mount_pages(app, source, playground=True, model_defaults=engine.lm.sampling_defaults)
