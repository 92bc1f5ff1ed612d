"""The RPC surface of a server on hivemind's P2P layer: forward and backward (unary and streamed), experts, adapter
files, info.

Each call kind has its own piece: span requests are read and refused as early as their first part allows by
:class:`~swarm.server.request_reader.RequestReader`, then computed and answered by
:class:`~swarm.server.span_calls.ForwardCalls` or :class:`~swarm.server.span_calls.BackwardCalls`; expert queries
go to :class:`~swarm.server.expert_handler.ExpertHandler`, adapter files to the server's
:class:`~swarm.adapters.sharing.AdapterLibrary`. Only a whole request takes a place in the compute queue (and, for
a push, in the push budget), so a peer that stalls its streams holds no compute slot. Every failure becomes a
structured error answer; one bad request never harms the server.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from typing import TYPE_CHECKING, AsyncIterable, AsyncIterator, Awaitable, Callable, Optional

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.asyncio import iter_as_aiter

from swarm.adapters.block import is_sha256_hex
from swarm.server.adapter_tensors import AdapterTensors
from swarm.server.backend import SpanBackend
from swarm.server.expert_handler import ExpertHandler
from swarm.server.push import Pusher, PushLimits
from swarm.server.request_reader import RequestReader
from swarm.server.session_cache import SessionCaches
from swarm.server.span_calls import BackwardCalls, ForwardCalls
from swarm.server.usage import UsageLedger
from swarm.server.validation import require
from swarm.server.work_check import StampCheck
from swarm.wire.encoding import MAX_STREAM_MESSAGE_BYTES, adapter_parts, error_response, parse_metadata
from swarm.wire.messages import ErrorCode, RemoteError
from swarm.wire.receipts import ReceiptSigner
from swarm.wire.services import SpanService

if TYPE_CHECKING:
    from swarm.adapters.sharing import AdapterLibrary

logger = logging.getLogger(__name__)

REFUSAL_LOG_PERIOD_S = 1.0  # refusals of one error code are logged at most this often


class ThrottledLog:
    """Warnings of one kind at most once per ``period`` seconds, with the count of those left out.

    A flood of refusals (a hundred busy answers a second to sybils) would otherwise spend the server's CPU, and
    its operator's disk, on log lines; ``rpc_info`` counts every refusal anyway."""

    def __init__(self, period: float):
        self.period = period
        self.last: dict[str, float] = {}
        self.skipped: Counter[str] = Counter()

    def warning(self, kind: str, message: str, *args) -> None:
        now = time.monotonic()
        if now - self.last.get(kind, -math.inf) < self.period:
            self.skipped[kind] += 1
            return
        self.last[kind] = now
        skipped = self.skipped.pop(kind, 0)
        suffix = f" ({skipped} more of this kind in the last {self.period:.0f} s)" if skipped else ""
        logger.warning(message + suffix, *args)


class ForwardHandler(SpanService):
    """Validates each request fully, then runs it on the backend (see the module doc).

    ``backend`` is None on a server that hosts only experts; ``experts`` is None on one that hosts none.
    """

    adapters: Optional["AdapterLibrary"] = None  # adapter files served by content hash (--serve-adapter)

    def __init__(self, backend: Optional[SpanBackend], *, hidden_size: int, max_batch_tokens: int, wire_dtype: str,
                 request_timeout: float, info: Callable[[], dict], experts: Optional[ExpertHandler] = None,
                 caches: Optional[SessionCaches] = None, num_layers: int = 0,
                 push_limits: PushLimits = PushLimits(), allow_backward: bool = True,
                 adapter_tensors: Optional[AdapterTensors] = None, usage: Optional[UsageLedger] = None,
                 receipts: Optional[ReceiptSigner] = None):
        self.backend = backend
        self.stamps = StampCheck()  # work stamps of requests: a caller's place in the fair order (scheduler.py)
        self.usage = usage if usage is not None else UsageLedger()  # per caller: what was computed for it
        self.adapter_tensors = adapter_tensors  # adapter tensors received, by digest (None: kept nowhere)
        self.allow_backward = allow_backward  # answer backward calls (training through the swarm)
        self.caches = caches
        self.pusher = Pusher(wire_dtype, request_timeout, push_limits)
        self.rows_computed = 0  # batch x length of hidden states run through the span
        self.compute_seconds = 0.0  # spent in the span's compute (queueing included), for benchmarks
        self.experts = experts
        if experts is not None:  # an expert request is one message, up to its own payload limit
            self.max_stream_message_bytes = max(MAX_STREAM_MESSAGE_BYTES, experts.max_payload_bytes)
        self.reader = RequestReader(backend, hidden_size=hidden_size, max_batch_tokens=max_batch_tokens,
                                    wire_dtype=wire_dtype, request_timeout=request_timeout, num_layers=num_layers,
                                    max_stream_message_bytes=self.max_stream_message_bytes,
                                    adapter_tensors=adapter_tensors)
        self.forward_calls = ForwardCalls(backend, self.pusher, caches, num_layers=num_layers, wire_dtype=wire_dtype,
                                          request_timeout=request_timeout, receipts=receipts)
        self.backward_calls = BackwardCalls(backend, request_timeout)
        self.request_timeout = request_timeout
        self.info = info
        self.accepting = True
        self.halt_reason: Optional[str] = None  # set while a valid governance halt stands
        self.requests_served = 0
        self.requests_failed = 0
        self.refusal_log = ThrottledLog(REFUSAL_LOG_PERIOD_S)

    # ----- RPCs ----------------------------------------------------------------------------------
    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        info = self.info()
        if self.adapter_tensors is not None:  # the caller's own uploads only: nobody learns another's use
            info["adapter_tensors"] = self.adapter_tensors.info(str(context.remote_id))
        return runtime_pb2.ExpertInfo(serialized_info=MSGPackSerializer.dumps(info))

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        parts = await self._answer(lambda: self._span_call(iter_as_aiter([request]), context, unary=True), context)
        if len(parts) != 1:  # checked before compute; kept so that a unary call can never get a stream
            return self._refuse(RemoteError(ErrorCode.TOO_LARGE, "response too large for a unary call"), context)
        return parts[0]

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for response in await self._answer(lambda: self._span_call(requests, context, unary=False), context):
            yield response

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest,
                           context: P2PContext) -> runtime_pb2.ExpertResponse:
        parts = await self._answer(
            lambda: self._span_call(iter_as_aiter([request]), context, unary=True, backward=True), context)
        if len(parts) != 1:  # checked before compute, as for forward
            return self._refuse(RemoteError(ErrorCode.TOO_LARGE, "response too large for a unary call"), context)
        return parts[0]

    async def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for response in await self._answer(lambda: self._span_call(requests, context, unary=False, backward=True),
                                           context):
            yield response

    async def rpc_expert_logits(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for response in await self._answer(lambda: self._expert_logits(request, context), context):
            yield response

    async def rpc_adapter_files(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for response in await self._answer(lambda: self._adapter_files(request), context):
            yield response

    # ----- one request -----------------------------------------------------------------------------
    async def _answer(self, work: Callable[[], Awaitable[list[runtime_pb2.ExpertResponse]]],
                      context: P2PContext) -> list[runtime_pb2.ExpertResponse]:
        """Run ``work`` unless shutting down; every failure becomes a structured error response."""
        try:
            require(self.accepting, ErrorCode.SHUTTING_DOWN, "server is shutting down")
            require(self.halt_reason is None, ErrorCode.HALTED,
                    f"the swarm is halted by governance: {self.halt_reason}")
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

    async def _expert_logits(self, request: runtime_pb2.ExpertRequest,
                             context: P2PContext) -> list[runtime_pb2.ExpertResponse]:
        require(self.experts is not None, ErrorCode.NO_EXPERT, "this server hosts no experts")
        return await self.experts.serve(request, str(context.remote_id))

    async def _adapter_files(self, request: runtime_pb2.ExpertRequest) -> list[runtime_pb2.ExpertResponse]:
        """The files of an adapter this server serves (``--serve-adapter``), named by their content hash."""
        sha256 = parse_metadata(request.metadata).get("sha256")
        require(is_sha256_hex(sha256), ErrorCode.BAD_REQUEST,
                "an adapter request names the files' sha256 (64 lowercase hex digits)")
        files = self.adapters.get(sha256) if self.adapters is not None else None
        require(files is not None, ErrorCode.NO_ADAPTER, f"this server does not serve adapter {sha256}")
        return adapter_parts(files)

    async def _span_call(self, requests: AsyncIterable[runtime_pb2.ExpertRequest], context: P2PContext,
                         unary: bool, backward: bool = False) -> list[runtime_pb2.ExpertResponse]:
        """A forward or backward call: read, admitted into the compute queue (and the push budget), computed,
        answered."""
        started = time.perf_counter()
        require(self.backend is not None, ErrorCode.WRONG_SPAN, "this server hosts experts only, no blocks")
        require(self.allow_backward or not backward, ErrorCode.NO_BACKWARD,
                "this server does not answer backward calls (it was started with --no-backward): train through "
                "another server")
        peer = str(context.remote_id)
        received = await self.reader.read(requests, peer, unary, backward)
        declared, queue = received.declared, self.backend.queue
        calls = self.backward_calls if backward else self.forward_calls
        proved = self.stamps.credit(declared.work, str(context.local_id), peer, time.time())
        with queue.admit(peer, received.cost, proved) as place, \
                self.forward_calls.push_place(peer, declared) as push_place:
            computing = time.perf_counter()
            output = await calls.compute(received, place)
            self.compute_seconds += time.perf_counter() - computing
            self.rows_computed += declared.tokens
            self.usage.record(peer, declared.tokens * (declared.end - declared.start), place.seconds, time.time())
            queue.records.complete(peer)
            logger.debug("%s %d:%d %s from %s in %.1f ms", "backward" if backward else "forward",
                         declared.start, declared.end, declared.shape, peer, 1000 * (time.perf_counter() - started))
            return calls.answer(received, output, push_place, place, floor=self.stamps.announced(time.time()))

    def _refuse(self, error: RemoteError, context: P2PContext) -> runtime_pb2.ExpertResponse:
        self.requests_failed += 1
        self.refusal_log.warning(error.code, "refused request from %s: %s", context.remote_id, error)
        return error_response(error)
