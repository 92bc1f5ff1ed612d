"""The FastAPI application: OpenAI-style completions over one :class:`GenerationEngine`.

Both generation endpoints run the same path (:func:`respond`); they differ only in how the prompt is made
(text or token ids vs. a conversation) and in the response shape (:mod:`swarm.api.responses`).

A client that hangs up stops its generation. Starlette tells a streamed response (it cancels the event
generator); a plain request is never told, so :func:`unless_disconnected` listens for the hang-up while the
request waits for the model and while it denoises, and cancels the wait, which cancels the worker.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import swarm
from swarm.api.body_limit import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from swarm.api.engine import GenerationEngine
from swarm.api.errors import ModelNotFound, as_api_error, error_body, install_error_handlers, raise_if_halted
from swarm.api.responses import CHAT, COMPLETION, SSE_DONE, ResponseBuilder, ResponseShape, sse
from swarm.api.schemas import ChatCompletionRequest, CompletionRequest, OpenAIFields
from swarm.frontend.lm import GenerationResult, StreamChunk
from swarm.utils.errors import SwarmError
from swarm.web import mount_api_pages

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0
DISCONNECT_POLL_S = 0.2  # pause between reads of a server that answers a read with empty body parts
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client abandoned (nobody reads it)

T = TypeVar("T")


class ClientDisconnected(SwarmError):
    """The client closed the connection before its answer was ready."""


def create_app(engine: GenerationEngine, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """An app serving ``engine``; the caller owns the engine (and closes it after the server stops).

    Request bodies over ``max_body_bytes`` are refused with 413 before they are parsed (:mod:`swarm.api.body_limit`).
    """
    app = FastAPI(title="diffusion-swarm", version=swarm.__version__,
                  description="OpenAI-style completions from a masked-diffusion LM, local or over a swarm.")
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.state.engine = engine
    app.state.started = int(time.time())
    install_error_handlers(app)
    mount_api_pages(app, engine)  # /map, /map.json, /playground (docs/WEB.md)

    @app.get("/health", summary="Liveness, and for a swarm whether every block is served")
    async def health() -> JSONResponse:
        try:
            report = await asyncio.wait_for(asyncio.to_thread(engine.health), HEALTH_TIMEOUT_S)
        except Exception as error:  # a probe must get an answer, whatever broke
            logger.warning("health check failed: %s", error)
            report = {"model": engine.model_id, "mode": engine.mode, "ok": False, "error": str(error)}
        report["status"] = "ok" if report["ok"] else "degraded"
        return JSONResponse(report, status_code=200 if report["ok"] else 503)

    @app.get("/v1/models", summary="The one model this server answers for")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(app)]}

    @app.get("/v1/models/{model_id:path}", summary="One model, or 404")
    async def get_model(model_id: str) -> dict[str, Any]:
        check_model(engine, model_id)
        return model_card(app)

    @app.post("/v1/completions", summary="Complete a prompt (text or token ids)")
    async def completions(request: CompletionRequest, connection: Request):
        return await respond(engine, request, request.prompt_input, COMPLETION, connection)

    @app.post("/v1/chat/completions", summary="Answer a conversation")
    async def chat_completions(request: ChatCompletionRequest, connection: Request):
        return await respond(engine, request, lambda: engine.chat_prompt(request.message_dicts()), CHAT, connection)

    return app


def model_card(app: FastAPI) -> dict[str, Any]:
    return {"id": app.state.engine.model_id, "object": "model", "created": app.state.started,
            "owned_by": "diffusion-swarm"}


def check_model(engine: GenerationEngine, name: str) -> None:
    if name != engine.model_id:
        raise ModelNotFound(f"the model {name!r} does not exist here; this server serves {engine.model_id!r}",
                            param="model", code="model_not_found")


async def respond(engine: GenerationEngine, request: OpenAIFields, make_prompt: Callable[[], str | list[int]],
                  shape: ResponseShape, connection: Request):
    """Validate, then answer with one JSON body or with a stream of step events.

    A stream is started only after its first step has come back, so that errors found on the way
    (settings, empty or too long prompts, a swarm missing blocks, a governance halt) still get a proper
    4xx/5xx status; a halt later in a stream ends it with an error event.
    Every bound is checked before the request waits for the model.
    """
    check_model(engine, request.model)
    builder = ResponseBuilder(shape, engine.model_id, request.stop_sequences)
    chunks = None
    try:
        settings = {**request.generation_kwargs(), **request.request_kwargs()}
        engine.check_settings(settings)
        prompt = await asyncio.to_thread(make_prompt)  # chat templates may tokenise a long conversation
        chunks = engine.stream(prompt, settings)
        first = await unless_disconnected(connection, anext(chunks))
        if first.done:
            raise_if_halted(first.result)  # halted before its first step: a 503, not an empty stream
        if request.stream:
            response = StreamingResponse(events(builder, first, chunks, request.include_usage),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            chunks = None  # the stream owns it now
            return response
        result = await unless_disconnected(connection, last_result(first, chunks))
        raise_if_halted(result)
        return builder.complete(result)
    except ClientDisconnected:
        logger.info("client disconnected; its generation was cancelled")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except Exception as error:
        raise as_api_error(error) from error
    finally:
        if chunks is not None:
            await chunks.aclose()


async def last_result(first: StreamChunk, rest: AsyncIterator[StreamChunk]) -> GenerationResult:
    """The result the last chunk carries."""
    result = first.result
    async for chunk in rest:
        result = chunk.result or result
    return result


async def hang_up(connection: Request) -> None:
    """Returns when the client disconnects: once the body is read, the server's next message is that one."""
    while (await connection.receive())["type"] != "http.disconnect":
        await asyncio.sleep(DISCONNECT_POLL_S)


async def unless_disconnected(connection: Request, work: Awaitable[T]) -> T:
    """Await ``work`` while the client stays connected; if it leaves, cancel ``work`` and raise ClientDisconnected.

    Cancelling a wait on :meth:`GenerationEngine.stream` closes it, which stops its worker after the current step.
    """
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(hang_up(connection))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientDisconnected()
        return task.result()
    finally:
        for pending in (task, gone):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending


async def events(builder: ResponseBuilder, first: StreamChunk, rest: AsyncIterator[StreamChunk],
                 include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one per denoising step, the final text, optional usage, then ``[DONE]``."""
    chunk, index = first, 0
    try:
        while True:
            if chunk.done:
                raise_if_halted(chunk.result)  # halted mid-stream: the error event below, no final text
                yield sse(builder.final_event(chunk.result, first=index == 0))
                if include_usage:
                    yield sse(builder.usage_event(chunk.result))
                break
            yield sse(builder.step_event(chunk, first=index == 0))
            chunk, index = await anext(rest), index + 1
        yield SSE_DONE
    except Exception as error:  # headers are sent: the error travels as an event, as OpenAI does
        api_error = as_api_error(error)
        yield sse(error_body(str(api_error), api_error.type, api_error.param, api_error.code))
    finally:
        await rest.aclose()
