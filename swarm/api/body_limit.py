"""A cap on request bodies, and their encoding, enforced before FastAPI parses them.

Without it, a body of any size is read into memory and parsed as JSON before a single setting is checked: one
request with a gigabyte of prompt could exhaust the API's host. The cap is checked on the declared
``Content-Length`` (refused before reading) and on the bytes actually received (a chunked body declares
none), and a refused request gets the API's usual error shape with status 413.

JSON over HTTP is UTF-8 (RFC 8259). Python's ``json`` also guesses UTF-16 and UTF-32 from the bytes, so a
body in another encoding would be read one way here and another way by any proxy or log in front: a body
that is not UTF-8, or holds a NUL byte (which JSON text never contains raw), gets a 400 instead.
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from swarm.api.errors import error_body

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above the longest prompt a model here accepts, as JSON
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodySizeLimit:
    """ASGI middleware: bodies over ``max_bytes`` get 413; smaller ones reach the app as if read directly."""

    def __init__(self, app: Callable[..., Awaitable[None]], max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self.refuse(send, declared.decode("latin-1")[:20] + " bytes declared")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it as it would
                return await self.app(scope, replay([message], receive), send)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self.refuse(send, f"more than {size} bytes sent")
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        problem = encoding_problem(whole["body"])
        if problem is not None:
            return await self.refuse(send, problem, status=400, code="invalid_encoding")
        await self.app(scope, replay([whole], receive), send)

    async def refuse(self, send: Send, what: str, status: int = 413, code: str = "request_too_large") -> None:
        message = what if status != 413 else f"request body too large ({what}); the limit is {self.max_bytes} bytes"
        body = json.dumps(error_body(message, "invalid_request_error", code=code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def encoding_problem(body: bytes) -> str | None:
    """Why ``body`` is not UTF-8 JSON text (None when it is, or is empty)."""
    if b"\x00" in body:
        return "the request body holds NUL bytes: JSON bodies are UTF-8 text (UTF-16 and UTF-32 are refused)"
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"the request body is not UTF-8 (byte {error.start}): JSON bodies are UTF-8 text"
    return None


def replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that hands out ``messages`` first, then the connection's own (disconnects, for streams)."""
    pending = list(messages)

    async def receive_again() -> Message:
        return pending.pop(0) if pending else await receive()

    return receive_again
