"""The RPC surface of a server on hivemind's P2P layer: forward (unary and streamed), experts, and info."""
from __future__ import annotations

import asyncio
import math
import logging
import time
from typing import AsyncIterator, Awaitable, Callable, Optional

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

import torch

from swarm.models.kv_cache import CacheMiss, SpanKV
from swarm.protocol import (
    ErrorCode, RemoteError, SpanService, ack_response, decode_tensor, error_response, join_parts, parse_metadata,
    response_parts,
)
from swarm.server.backend import SpanBackend
from swarm.server.expert_handler import ExpertHandler
from swarm.server.push import Pusher, PushSpec
from swarm.server.session_cache import SessionCaches
from swarm.server.validation import is_count, require, validate_hidden, validate_metadata

logger = logging.getLogger(__name__)

PAYLOAD_SLACK_BYTES = 64 * 1024


class ForwardHandler(SpanService):
    """Validates each request fully, then runs it on the backend. One bad request never harms the server.

    ``backend`` is None on a server that hosts only experts; ``experts`` is None on one that hosts none.
    """

    def __init__(self, backend: Optional[SpanBackend], *, hidden_size: int, max_batch_tokens: int, wire_dtype: str,
                 request_timeout: float, info: Callable[[], dict], experts: Optional[ExpertHandler] = None,
                 caches: Optional[SessionCaches] = None, num_layers: int = 0):
        self.backend = backend
        self.caches = caches
        self.num_layers = num_layers
        self.pusher = Pusher(wire_dtype, request_timeout)
        self.rows_computed = 0  # batch x length of hidden states run through the span
        self.experts = experts
        self.hidden_size = hidden_size
        self.max_batch_tokens = max_batch_tokens
        self.max_payload_bytes = max_batch_tokens * hidden_size * 4 + PAYLOAD_SLACK_BYTES
        self.wire_dtype = wire_dtype
        self.request_timeout = request_timeout
        self.info = info
        self.accepting = True
        self.halt_reason: Optional[str] = None  # set while a valid governance halt stands
        self.requests_served = 0
        self.requests_failed = 0

    # ----- RPCs ----------------------------------------------------------------------------------
    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        return runtime_pb2.ExpertInfo(serialized_info=MSGPackSerializer.dumps(self.info()))

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        parts = await self._serve([request], context)
        if len(parts) != 1:  # the client asked for unary but the answer needs a stream
            return error_response(RemoteError(ErrorCode.TOO_LARGE, "response too large for a unary call: use the stream RPC"))
        return parts[0]

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        received, size = [], 0
        async for part in requests:
            size += part.ByteSize()
            if size > self.max_payload_bytes:
                yield self._refuse(RemoteError(ErrorCode.TOO_LARGE, f"payload over {self.max_payload_bytes} bytes"), context)
                return
            received.append(part)
        for response in await self._serve(received, context):
            yield response

    async def rpc_expert_logits(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for response in await self._answer(lambda: self._expert_logits(request), context):
            yield response

    # ----- one request -----------------------------------------------------------------------------
    async def _answer(self, work: Callable[[], Awaitable[list[runtime_pb2.ExpertResponse]]],
                      context: P2PContext) -> list[runtime_pb2.ExpertResponse]:
        """Run ``work`` unless shutting down; every failure becomes a structured error response."""
        try:
            require(self.accepting, ErrorCode.SHUTTING_DOWN, "server is shutting down")
            require(self.halt_reason is None, ErrorCode.HALTED, f"the swarm is halted by governance: {self.halt_reason}")
            parts = await work()
            self.requests_served += 1
            return parts
        except RemoteError as error:
            return [self._refuse(error, context)]
        except asyncio.TimeoutError:
            return [self._refuse(RemoteError(ErrorCode.BUSY, f"compute took over {self.request_timeout} s"), context)]
        except Exception as error:  # a bug must not take the server down; the client gets a clear error
            logger.exception("internal error serving %s", context.remote_id)
            return [self._refuse(RemoteError(ErrorCode.INTERNAL, f"{type(error).__name__}: {error}"), context)]

    async def _serve(self, parts: list[runtime_pb2.ExpertRequest], context: P2PContext) -> list[runtime_pb2.ExpertResponse]:
        return await self._answer(lambda: self._forward(parts, context), context)

    async def _expert_logits(self, request: runtime_pb2.ExpertRequest) -> list[runtime_pb2.ExpertResponse]:
        require(self.experts is not None, ErrorCode.NO_EXPERT, "this server hosts no experts")
        return await self.experts.serve(request)

    async def _forward(self, parts: list[runtime_pb2.ExpertRequest], context: P2PContext) -> list[runtime_pb2.ExpertResponse]:
        started = time.perf_counter()
        require(self.backend is not None, ErrorCode.WRONG_SPAN, "this server hosts experts only, no blocks")
        require(len(parts) > 0, ErrorCode.BAD_REQUEST, "empty request")
        require(sum(p.ByteSize() for p in parts) <= self.max_payload_bytes, ErrorCode.TOO_LARGE,
                f"payload over {self.max_payload_bytes} bytes")
        metadata = parse_metadata(parts[0].metadata)
        start, end = validate_metadata(metadata, (self.backend.start, self.backend.end))
        tensors = [t for p in parts for t in p.tensors]
        proto = join_parts(tensors, metadata.get("parts"))
        require(math.prod(proto.size) <= self.max_batch_tokens * self.hidden_size, ErrorCode.TOO_LARGE,
                f"tensor of shape {tuple(proto.size)} exceeds the batch-token limit {self.max_batch_tokens}")
        hidden = decode_tensor(proto)
        validate_hidden(hidden, self.hidden_size, self.max_batch_tokens)
        extra = metadata.get("extra", {})
        push = PushSpec.parse(extra["push"], self.num_layers, end) if "push" in extra else None
        session_id = metadata.get("session_id", "")
        try:  # no cache for this session here, or one filled for another batch or blocks: the client refills
            kv, rows, fill = await self._cache_for(extra, session_id, hidden, start, end)
            computed = False
            try:
                output = await asyncio.wait_for(self.backend.forward(hidden, start, end, kv, rows),
                                                self.request_timeout)
                computed = True
            finally:
                if fill is not None:  # reuses waiting for this fill go on (or miss, when it failed)
                    self.caches.filled(session_id, fill, kv, ok=computed)
        except CacheMiss as miss:
            raise RemoteError(ErrorCode.CACHE_MISS, str(miss)) from None
        self.rows_computed += hidden.shape[0] * hidden.shape[1]
        logger.debug("forward %d:%d %s rows %s from %s in %.1f ms", start, end, tuple(hidden.shape), rows,
                     context.remote_id, 1000 * (time.perf_counter() - started))
        if push is not None:
            self.pusher.send(push, output, session_id, metadata.get("step", -1),
                             {k: v for k, v in extra.items() if k != "push"})
            return [ack_response()]
        return response_parts(output, self.wire_dtype)

    async def _cache_for(self, extra: dict, session_id: str, hidden: torch.Tensor, start: int, end: int
                         ) -> tuple[Optional[SpanKV], Optional[tuple[int, int]], Optional[int]]:
        """The session cache a request fills (``extra["cache"]["rows"]`` None) or reuses (rows [a, b]), the
        rows it computes, and the version it fills (None for a reuse or an uncached request)."""
        if "cache" not in extra:
            return None, None, None
        directive = extra["cache"]
        require(isinstance(directive, dict) and "rows" in directive, ErrorCode.BAD_REQUEST,
                "extra['cache'] must be a map with 'rows' (null to fill, [start, end] to reuse)")
        version, keep_from = directive.get("version"), directive.get("keep_from", 0)
        require(is_count(version) and is_count(keep_from) and keep_from <= version, ErrorCode.BAD_REQUEST,
                f"cache version and keep_from must be integers with 0 <= keep_from <= version < 2**31, got "
                f"{version!r} and {keep_from!r}")
        require(bool(session_id), ErrorCode.BAD_REQUEST, "a cached request needs a session_id")
        if self.caches is None:
            raise CacheMiss("this server keeps no activation cache")
        batch, length = hidden.shape[:2]
        rows = directive["rows"]
        if rows is None:
            kv = self.caches.for_fill(session_id, version, keep_from, end - start, batch, length)
            return kv, None, version
        require(isinstance(rows, list) and len(rows) == 2 and all(isinstance(r, int) for r in rows)
                and 0 <= rows[0] < rows[1], ErrorCode.BAD_REQUEST, f"cache rows must be [start, end], got {rows!r}")
        require(rows[1] - rows[0] == length, ErrorCode.BAD_REQUEST,
                f"cache rows {rows[0]}:{rows[1]} do not match the {length} positions sent")
        kv = await self.caches.for_reuse(session_id, version)
        return kv, (rows[0], rows[1]), None

    def _refuse(self, error: RemoteError, context: P2PContext) -> runtime_pb2.ExpertResponse:
        self.requests_failed += 1
        logger.warning("refused request from %s: %s", context.remote_id, error)
        return error_response(error)
