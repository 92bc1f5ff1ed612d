"""The RPC surface of a server on hivemind's P2P layer: forward and backward (unary and streamed), experts, info.

A forward request is refused as early as its first part allows: the metadata, the declared tensor shape (within
the model's context), whether its answer fits a unary call, and whether the compute queue has room are all settled
before the rest of its payload is received, decoded or computed. The rest of a stream is received under a place
among the unfinished streams and a deadline proportional to its declared size (``StreamLimits``); only a whole
request takes a place in the compute queue (and, for a push, in the push budget), so a peer that stalls its
streams holds no compute slot. A pass whose caller stopped waiting is cancelled between blocks. A backward request
(:class:`~swarm.protocol.BackwardRequest`) has a forward request's form and takes the same path, with its own
checks: no cache, push or head directives, an even stacked batch, and a server that answers backward calls.

Either kind may carry a per-block adapter's tensor for the requested blocks (``prompt_length`` R in the metadata,
``prompt_kind`` deep_prompt, bottleneck or lora): its shape (blocks, R, hidden), dtype, size (R at most the
kind's limit and a size the kind can have, blocks x R at most ``--max-batch-tokens``), kind and finite values are
checked like the hidden states', and it counts in the request's declared payload. A pushed request may not carry
one (the next hops would need their own). A tensor received is kept by its digest (``swarm/server/adapter_tensors.py``)
and the answer says so (``prompt_held``): the client's later calls name it (``prompt_digest``) instead of sending
it, and one the server no longer holds is refused with ``adapter_miss`` before anything else is received.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterable, AsyncIterator, Awaitable, Callable, Optional, TypeVar

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.asyncio import iter_as_aiter

from swarm.adapters.block import BlockAdapter, is_sha256_hex
from swarm.adapters.kinds import DEEP_PROMPT
from swarm.adapters.lora import BlockWidths
from swarm.diffusion.prediction import HeadQuery
from swarm.models.kv_cache import CacheMiss, SpanKV
from swarm.protocol import (
    AUTO_WIRE,
    MAX_STREAM_MESSAGE_BYTES,
    MAX_UNARY_BYTES,
    ErrorCode,
    RemoteError,
    SpanService,
    ack_response,
    adapter_parts,
    decode_tensor,
    error_response,
    join_parts,
    parse_metadata,
    response_parts,
    tensor_wire_bytes,
)
from swarm.server.adapter_tensors import AdapterTensors
from swarm.server.backend import Grant, SpanBackend
from swarm.server.expert_handler import ExpertHandler
from swarm.server.push import Pusher, PushLimits, PushSpec
from swarm.server.session_cache import SessionCaches
from swarm.server.validation import (
    is_count,
    require,
    validate_adapter,
    validate_declared,
    validate_hidden,
    validate_metadata,
    validate_positions,
    validate_prompt_declared,
)

if TYPE_CHECKING:
    from swarm.adapters.sharing import AdapterLibrary

logger = logging.getLogger(__name__)

T = TypeVar("T")

PAYLOAD_SLACK_BYTES = 64 * 1024
REFUSAL_LOG_PERIOD_S = 1.0  # refusals of one error code are logged at most this often
MIN_CHUNK_BYTES = 2**16  # the smallest stream chunk a client may use (hivemind's default): bounds the part count


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


@dataclass(frozen=True)
class Declared:
    """What the first part of a forward request says about the whole request, checked before the rest."""

    metadata: dict
    start: int
    end: int
    shape: tuple[int, int, int]
    parts: int  # messages the request comes in
    max_bytes: int  # the most its parts may weigh together
    push: Optional[PushSpec]
    head: Optional[HeadQuery] = None  # answer the sampler's predictions instead of hidden states
    backward: bool = False  # the tensor stacks the span's inputs and its output gradient: answer the input gradient
    prompt_length: int = 0  # rows per block of the per-block adapter tensor the request carries (0: none)
    prompt_parts: int = 0  # the messages' tensor parts holding it, after the hidden states' ``parts``
    prompt_kind: str = DEEP_PROMPT  # how the blocks apply it (a deep prompt's vectors, a bottleneck's weights, a LoRA)
    held_adapter: Optional[BlockAdapter] = None  # the adapter the request named by digest, from the server's store

    @property
    def prompt_shape(self) -> tuple[int, int, int]:
        return (self.end - self.start, self.prompt_length, self.shape[2])

    @property
    def tokens(self) -> int:
        """Positions the request carries (a backward request's inputs and gradients both count: it computes more)."""
        return self.shape[0] * self.shape[1]


class ForwardHandler(SpanService):
    """Validates each request fully, then runs it on the backend. One bad request never harms the server.

    ``backend`` is None on a server that hosts only experts; ``experts`` is None on one that hosts none.
    """

    adapters: Optional["AdapterLibrary"] = None  # adapter files served by content hash (--serve-adapter)

    def __init__(self, backend: Optional[SpanBackend], *, hidden_size: int, max_batch_tokens: int, wire_dtype: str,
                 request_timeout: float, info: Callable[[], dict], experts: Optional[ExpertHandler] = None,
                 caches: Optional[SessionCaches] = None, num_layers: int = 0,
                 push_limits: PushLimits = PushLimits(), allow_backward: bool = True,
                 adapter_tensors: Optional[AdapterTensors] = None):
        self.backend = backend
        self.adapter_tensors = adapter_tensors  # adapter tensors received, by digest (None: kept nowhere)
        self.allow_backward = allow_backward  # answer backward calls (training through the swarm)
        self.caches = caches
        self.num_layers = num_layers
        self.pusher = Pusher(wire_dtype, request_timeout, push_limits)
        self.rows_computed = 0  # batch x length of hidden states run through the span
        self.compute_seconds = 0.0  # spent in the span's compute (queueing included), for benchmarks
        self.experts = experts
        if experts is not None:  # an expert request is one message, up to its own payload limit
            self.max_stream_message_bytes = max(MAX_STREAM_MESSAGE_BYTES, experts.max_payload_bytes)
        self.hidden_size = hidden_size
        self.max_batch_tokens = max_batch_tokens
        self.max_payload_bytes = max_batch_tokens * hidden_size * 4 + PAYLOAD_SLACK_BYTES
        # a first message may also carry a deep prompt, which weighs at most as much as the hidden states
        self.max_first_bytes = 2 * max_batch_tokens * hidden_size * 4 + PAYLOAD_SLACK_BYTES
        self.wire_dtype = wire_dtype
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
        parts = await self._answer(lambda: self._forward(iter_as_aiter([request]), context, unary=True), context)
        if len(parts) != 1:  # checked before compute; kept so that a unary call can never get a stream
            return self._refuse(RemoteError(ErrorCode.TOO_LARGE, "response too large for a unary call"), context)
        return parts[0]

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for response in await self._answer(lambda: self._forward(requests, context, unary=False), context):
            yield response

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest,
                           context: P2PContext) -> runtime_pb2.ExpertResponse:
        parts = await self._answer(
            lambda: self._forward(iter_as_aiter([request]), context, unary=True, backward=True), context)
        if len(parts) != 1:  # checked before compute, as for forward
            return self._refuse(RemoteError(ErrorCode.TOO_LARGE, "response too large for a unary call"), context)
        return parts[0]

    async def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for response in await self._answer(lambda: self._forward(requests, context, unary=False, backward=True),
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

    async def _forward(self, requests: AsyncIterable[runtime_pb2.ExpertRequest], context: P2PContext,
                       unary: bool, backward: bool = False) -> list[runtime_pb2.ExpertResponse]:
        started = time.perf_counter()
        require(self.backend is not None, ErrorCode.WRONG_SPAN, "this server hosts experts only, no blocks")
        require(self.allow_backward or not backward, ErrorCode.NO_BACKWARD,
                "this server does not answer backward calls (it was started with --no-backward): train through "
                "another server")
        stream = aiter(requests)
        peer = str(context.remote_id)
        if not unary:  # no stream place for this peer now: refused before its first part is even read
            self.backend.queue.unfinished.check(peer, 0, self.backend.queue.records.known(peer))
        first = await self._first_part(stream, peer)
        declared = self._declared(first, unary, peer, backward)
        queue, cost = self.backend.queue, self.backend.cost(*declared.shape[:2])
        queue.check(peer, cost)  # no room now: refused before the rest is received
        hidden, adapter, held = await self._receive(first, stream, declared, peer, unary, cost)
        with queue.admit(peer, cost) as place, self._push_place(peer, declared) as push_place:
            answer = {"prompt_held": True} if held else None
            extra = declared.metadata.get("extra", {})
            session_id = declared.metadata.get("session_id", "")
            computing = time.perf_counter()
            grad_prompts = None
            if declared.backward:
                output, grad_prompts = await self._backward(hidden, adapter, declared, place)
            else:
                output = await self._compute(hidden, adapter, declared, extra, session_id, place)
            self.compute_seconds += time.perf_counter() - computing
            self.rows_computed += declared.tokens
            queue.records.complete(peer)
            logger.debug("%s %d:%d %s from %s in %.1f ms", "backward" if declared.backward else "forward",
                         declared.start, declared.end, declared.shape, peer, 1000 * (time.perf_counter() - started))
            if declared.backward:  # gradients travel in float32, unrounded
                return response_parts(output, AUTO_WIRE, answer, prompts=grad_prompts)
            if declared.push is None:
                return response_parts(output, self.wire_dtype, answer)
            self.pusher.send(declared.push, output, session_id, declared.metadata.get("step", -1),
                             {k: v for k, v in extra.items() if k != "push"}, push_place)
            return [ack_response()]

    def _declared(self, first: runtime_pb2.ExpertRequest, unary: bool, peer: str, backward: bool = False
                  ) -> Declared:
        """Check everything the first part says, before the rest is received or anything computed."""
        require(first.ByteSize() <= self.max_first_bytes, ErrorCode.TOO_LARGE,
                f"payload over {self.max_first_bytes} bytes")
        metadata = parse_metadata(first.metadata)
        start, end = validate_metadata(metadata, (self.backend.start, self.backend.end))
        prompt_length, prompt_parts, prompt_kind = validate_prompt_declared(
            metadata, end - start, self.max_batch_tokens, BlockWidths.of(self.backend.span.config))
        require(len(first.tensors) == 1 or (len(first.tensors) == 2 and prompt_parts == 1), ErrorCode.BAD_REQUEST,
                f"the first part must carry one tensor (two: the hidden states and an adapter's of one part each), "
                f"it carries {len(first.tensors)}")
        proto = first.tensors[0]
        batch, length = validate_declared(proto.dtype, tuple(proto.size), self.hidden_size, self.max_batch_tokens)
        validate_positions(length, self.backend.max_positions)
        shape = (batch, length, self.hidden_size)
        held = self._held_adapter(metadata.get("prompt_digest"), prompt_kind, (end - start, prompt_length), peer)
        prompt_bytes = 4 * (end - start) * prompt_length * self.hidden_size if prompt_parts else 0
        max_bytes = min(self.max_payload_bytes, 4 * math.prod(shape) + PAYLOAD_SLACK_BYTES) + prompt_bytes
        parts, max_parts = metadata.get("parts"), self.max_payload_bytes // MIN_CHUNK_BYTES + 1
        require(is_count(parts) and 0 < parts <= max_parts, ErrorCode.BAD_REQUEST,
                f"metadata 'parts' must be an integer in 1..{max_parts}, got {parts!r}")
        require(len(first.tensors) == 1 or parts == 1, ErrorCode.BAD_REQUEST,
                "the hidden states and an adapter's tensor share the first part only when each is one part")
        require(first.ByteSize() <= max_bytes, ErrorCode.TOO_LARGE,
                f"first part of {first.ByteSize()} bytes, over the {max_bytes} its declared shapes need")
        extra = metadata.get("extra", {})
        prompted = dict(prompt_length=prompt_length, prompt_parts=prompt_parts, prompt_kind=prompt_kind,
                        held_adapter=held)
        if backward:
            self._check_backward(extra, batch)
            if unary:
                self._check_unary_answer([(batch // 2, length, self.hidden_size)]
                                         + [(end - start, prompt_length, self.hidden_size)] * bool(prompt_length),
                                         AUTO_WIRE, torch.float32)
            return Declared(metadata, start, end, shape, parts, max_bytes, None, None, backward=True, **prompted)
        require(not (prompt_length and "push" in extra), ErrorCode.BAD_REQUEST,
                "a pushed request cannot carry a deep prompt (the next hops need their own blocks' vectors): send "
                "it hop by hop")
        push = PushSpec.parse(extra["push"], self.num_layers, end) if "push" in extra else None
        head = self._head_query(extra, end, batch, length)
        if unary and push is None:
            self._check_unary_answer([shape], self.wire_dtype, self.backend.dtype)
        return Declared(metadata, start, end, shape, parts, max_bytes, push, head, **prompted)

    def _held_adapter(self, digest: Optional[str], kind: str, blocks_rows: tuple[int, int], peer: str
                      ) -> Optional[BlockAdapter]:
        """The adapter ``peer`` sent earlier and now names by ``digest`` (None when it names none), of its
        declared kind and (blocks, R); ``adapter_miss`` when this server does not hold it (any more) for that peer:
        the client sends it again. Only the peer's own uploads are found, so a digest tells nobody else anything."""
        if digest is None:
            return None
        found = self.adapter_tensors.get(digest, peer) if self.adapter_tensors is not None else None
        require(found is not None, ErrorCode.ADAPTER_MISS,
                f"no adapter tensor {digest[:16]}... here (evicted, or never sent to this server): send it")
        shape = (*blocks_rows, self.hidden_size)
        require(found.kind == kind and tuple(found.weights.shape) == shape, ErrorCode.BAD_REQUEST,
                f"adapter tensor {digest[:16]}... is a {found.kind} of shape {tuple(found.weights.shape)}, the "
                f"request declares a {kind} of {shape}")
        return found

    @staticmethod
    def _check_unary_answer(shapes: list[tuple[int, int, int]], wire_dtype: str, dtype: torch.dtype) -> None:
        answer = sum(tensor_wire_bytes(shape, wire_dtype, dtype) for shape in shapes)
        require(answer <= MAX_UNARY_BYTES, ErrorCode.TOO_LARGE,
                f"the answer ({answer} bytes in {wire_dtype}) does not fit a unary call of at most "
                f"{MAX_UNARY_BYTES} bytes: send this request on the stream RPC")

    @staticmethod
    def _check_backward(extra: dict, batch: int) -> None:
        """A backward request stacks inputs and output gradients (an even batch) and carries no directive."""
        require(not extra, ErrorCode.BAD_REQUEST,
                f"a backward request takes no cache, push or head directive, got {sorted(extra)}")
        require(batch % 2 == 0, ErrorCode.BAD_REQUEST,
                f"a backward request stacks inputs and output gradients along the batch: its batch ({batch}) must "
                f"be even")

    def _head_query(self, extra: dict, end: int, batch: int, length: int) -> Optional[HeadQuery]:
        """The request's head query, for the hop that ends at the last block (earlier hops pass it on)."""
        if "head" not in extra or end != self.num_layers:
            return None
        head = self.backend.head
        require(head is not None, ErrorCode.WRONG_SPAN, "this server holds no output head (it was started "
                "without --head): ask for hidden states")
        try:
            return HeadQuery.parse(extra["head"], batch, length, head.config.vocab_size)
        except ValueError as error:
            raise RemoteError(ErrorCode.BAD_REQUEST, str(error)) from None

    def _push_place(self, peer: str, declared: Declared) -> contextlib.AbstractContextManager[Optional[Grant]]:
        """A place in the push budget for a pushed request's output (nothing for other requests)."""
        if declared.push is None:
            return contextlib.nullcontext()
        return self.pusher.reserve(peer, declared.shape)

    async def _first_part(self, stream: AsyncIterator[runtime_pb2.ExpertRequest], peer: str
                          ) -> runtime_pb2.ExpertRequest:
        """The request's first part, within the deadline of one stream message: a stream that sends nothing
        holds an open stream until then, no longer."""
        deadline = self.backend.queue.streams.deadline(self.max_stream_message_bytes, self.request_timeout)
        first = await self._within(anext(stream, None), deadline, peer, "its first part")
        require(first is not None, ErrorCode.BAD_REQUEST, "empty request")
        return first

    async def _within(self, work: Awaitable[T], deadline: float, peer: str, what: str) -> T:
        """``work`` (reading a stream), or ``incomplete`` when the stream did not deliver ``what`` by ``deadline``:
        the stream is dropped, counted, and its sender loses its record of completed requests."""
        try:
            return await asyncio.wait_for(work, deadline)
        except asyncio.TimeoutError:
            self.backend.queue.stream_dropped(peer)
            raise RemoteError(ErrorCode.INCOMPLETE, f"the request stream did not deliver {what} within {deadline:.1f} "
                              f"s (--receive-timeout, --receive-rate-mb)") from None

    async def _receive(self, first: runtime_pb2.ExpertRequest, stream: AsyncIterator[runtime_pb2.ExpertRequest],
                       declared: Declared, peer: str, unary: bool, cost: int
                       ) -> tuple[torch.Tensor, Optional[BlockAdapter], bool]:
        """The rest of the request's parts, within its declared size and its deadline, decoded: the hidden
        states and the per-block adapter (None when the request has none; the held one when it named it), both
        validated, and whether a tensor that came is now kept for later calls to name. A stream holds a place
        among the unfinished streams meanwhile (a unary call has nothing more to receive)."""
        chunks, size = list(first.tensors), first.ByteSize()
        expected = declared.parts + declared.prompt_parts

        async def rest() -> None:
            nonlocal size
            async for part in stream:
                size += part.ByteSize()
                require(size <= declared.max_bytes, ErrorCode.TOO_LARGE,
                        f"payload over {declared.max_bytes} bytes, the most shape {declared.shape} needs")
                require(len(chunks) < expected and len(part.tensors) == 1, ErrorCode.BAD_REQUEST,
                        f"the stream sends more than its {expected} declared parts of one tensor each")
                chunks.append(part.tensors[0])

        queue = self.backend.queue
        with contextlib.nullcontext() if unary else queue.receive_place(peer, cost):
            deadline = queue.streams.deadline(declared.max_bytes, self.request_timeout)
            await self._within(rest(), deadline, peer, f"its {expected} parts")
        require(len(chunks) == expected, ErrorCode.INCOMPLETE, f"stream ended after {len(chunks)} of {expected} parts")
        hidden = decode_tensor(join_parts(chunks[:declared.parts], declared.parts))
        validate_hidden(hidden, self.hidden_size, self.max_batch_tokens)
        require(tuple(hidden.shape) == declared.shape, ErrorCode.BAD_REQUEST,
                f"hidden states of shape {tuple(hidden.shape)}, the first part declared {declared.shape}")
        if not declared.prompt_length or declared.held_adapter is not None:
            return hidden, declared.held_adapter, False
        weights = decode_tensor(join_parts(chunks[declared.parts:], declared.prompt_parts))
        adapter = BlockAdapter(declared.prompt_kind, weights)
        validate_adapter(adapter, declared.prompt_shape)
        if self.adapter_tensors is None or not self.adapter_tensors.enabled:
            return hidden, adapter, False
        digest = await asyncio.to_thread(adapter.digest)  # ~1 GB/s: off the loop
        return hidden, adapter, self.adapter_tensors.put(digest, adapter, peer)

    async def _compute(self, hidden: torch.Tensor, adapter: Optional[BlockAdapter], declared: Declared, extra: dict,
                       session_id: str, place: Grant) -> torch.Tensor:
        """Run the span under ``place`` (the compute queue releases it when the work leaves its thread),
        filling or reusing the session's cache as ``extra`` says."""
        try:  # no cache for this session here, or one filled for another batch or blocks: the client refills
            kv, rows, fill = await self._cache_for(extra, session_id, hidden, declared.start, declared.end)
            computed = False
            try:
                output = await asyncio.wait_for(
                    self.backend.forward(hidden, declared.start, declared.end, kv, rows, grant=place,
                                         head=declared.head, adapter=adapter),
                    self.request_timeout)
                computed = True
            finally:
                if fill is not None:  # reuses waiting for this fill go on (or miss, when it failed)
                    self.caches.filled(session_id, fill, kv, ok=computed)
        except CacheMiss as miss:
            raise RemoteError(ErrorCode.CACHE_MISS, str(miss)) from None
        return output

    async def _backward(self, stacked: torch.Tensor, adapter: Optional[BlockAdapter], declared: Declared,
                        place: Grant) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The gradients of the span's input (and of the deep prompt, when one came) from the stacked inputs and
        output gradients, under ``place``."""
        inputs, grad_outputs = stacked.chunk(2)
        return await asyncio.wait_for(
            self.backend.backward(inputs, grad_outputs, declared.start, declared.end, grant=place, adapter=adapter),
            self.request_timeout)

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
        self.refusal_log.warning(error.code, "refused request from %s: %s", context.remote_id, error)
        return error_response(error)
