"""Every failure as OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``.

OpenAI clients read that shape to raise their typed exceptions (``BadRequestError``, ``NotFoundError``…),
so validation errors, unknown routes and failures inside generation all answer with it. FastAPI is imported where
the handlers are installed: the errors and :func:`error_body` serve ``swarm.api.body_limit`` too, whose default
``python -m swarm.api --help`` shows without loading FastAPI.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from swarm.cli.options import halt_message
from swarm.utils.errors import SwarmError

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError

    from swarm.frontend.lm import GenerationResult

logger = logging.getLogger(__name__)


class APIError(SwarmError):
    """An error with its HTTP status, raised anywhere in a request and answered by the handler below."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.param, self.code = param, code


class APIRequestError(APIError, ValueError):
    """Well-formed JSON asking for something inconsistent (two lengths that disagree, several prompts)."""

    status = 400
    type = "invalid_request_error"


class ModelNotFound(APIError):
    status = 404
    type = "invalid_request_error"


class Unavailable(APIError):
    """The model cannot answer now (swarm not fully served, too many waiting requests): retry later."""

    status = 503
    type = "service_unavailable"


def raise_if_halted(result: "GenerationResult") -> None:
    """A generation a governance halt stopped (:class:`~swarm.governance.guard.SwarmHalted`, turned into the result's
    ``info["halt"]``) is an error for the caller, not a short completion: 503 with ``code: swarm_halted``."""
    if result.finish_reason == "halted":
        raise Unavailable(halt_message(result.info.get("halt") or {}), code="swarm_halted")


def error_body(message: str, type_: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def as_api_error(error: BaseException) -> APIError:
    """Map an exception from generation to the status a client should see.

    The sampler and the tokenizer raise ValueError for bad settings and prompts (400; a setting's name as
    ``param`` when it says one); the engine's busy signal, a swarm with uncovered blocks and an expert no
    server hosts are temporary (503); anything else is our fault (500).
    """
    from swarm.api.engine import EngineBusy
    from swarm.client.routing import MissingBlocksError
    from swarm.diffusion.experts import ExpertNotFoundError

    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):
        return APIRequestError(str(error), param=getattr(error, "param", None))
    if isinstance(error, (EngineBusy, MissingBlocksError, ExpertNotFoundError)):
        return Unavailable(str(error))
    logger.error("generation failed", exc_info=error)
    return APIError(f"generation failed: {type(error).__name__}: {error}")


def describe_validation(error: RequestValidationError) -> tuple[str, Optional[str]]:
    """A one-line message naming the offending fields, and the first field as OpenAI's ``param``."""
    by_field: dict[str, list[tuple[str, str]]] = {}
    for item in error.errors():
        if item.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {item.get('ctx', {}).get('error', item['msg'])}", None
        location = [str(part) for part in item.get("loc", ())[1:]] or ["body"]
        by_field.setdefault(location[0], []).append((".".join(location[1:]), item["msg"]))
    problems = []
    for name, items in by_field.items():
        if len(items) > 1 and all(rest for rest, _ in items):  # a union: pydantic reports each alternative
            problems.append(f"{name}: expected {' or '.join(rest for rest, _ in items)}")
        else:
            rest, message = items[0]
            problems.append(f"{'.'.join(filter(None, (name, rest)))}: {message}")
    return "invalid request: " + "; ".join(problems[:4]), next(iter(by_field), None)


def install_error_handlers(app: FastAPI) -> None:
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error_body(str(error), error.type, error.param, error.code), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = describe_validation(error)
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(error.detail), "invalid_request_error"), status_code=error.status_code,
                            headers=getattr(error, "headers", None))
