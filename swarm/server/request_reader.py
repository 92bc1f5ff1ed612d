"""Reading one forward or backward request from its stream, refused as early as its first part allows.

The metadata, the declared tensor shape (within the model's context), whether its answer fits a unary call, and
whether the compute queue has room are all settled before the rest of its payload is received, decoded or
computed. The rest of a stream is received under a place among the unfinished streams and a deadline proportional
to its declared size (``StreamLimits``), so a peer that stalls its streams holds no compute slot. A backward request
(:class:`~swarm.wire.messages.BackwardRequest`) has a forward request's form and is read the same way, with its own
checks: no cache, push or head directives, and an even stacked batch.

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
import math
from dataclasses import dataclass
from typing import AsyncIterable, AsyncIterator, Awaitable, Optional, TypeVar

import torch
from hivemind.proto import runtime_pb2

from swarm.adapters.block import BlockAdapter
from swarm.adapters.kinds import DEEP_PROMPT
from swarm.adapters.lora import BlockWidths
from swarm.diffusion.pipeline import CacheDirective
from swarm.diffusion.prediction import HeadQuery
from swarm.server.adapter_tensors import AdapterTensors
from swarm.server.backend import SpanBackend
from swarm.server.push import parse_push
from swarm.server.validation import (
    is_count,
    parse_cache,
    require,
    validate_adapter,
    validate_declared,
    validate_hidden,
    validate_metadata,
    validate_positions,
    validate_prompt_declared,
)
from swarm.wire.encoding import AUTO_WIRE, MAX_UNARY_BYTES, decode_tensor, join_parts, parse_metadata, tensor_wire_bytes
from swarm.wire.messages import ErrorCode, PushSpec, RemoteError
from swarm.wire.receipts import CallContent, tensor_digest
from swarm.wire.work import WorkStamp, parse_work

T = TypeVar("T")

PAYLOAD_SLACK_BYTES = 64 * 1024
MIN_CHUNK_BYTES = 2**16  # the smallest stream chunk a client may use (hivemind's default): bounds the part count


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
    head: Optional[HeadQuery] = None  # the sampler's query: a hop that ends at the last block answers predictions
    cache: Optional[CacheDirective] = None  # fill or reuse the session's activation cache
    backward: bool = False  # the tensor stacks the span's inputs and its output gradient: answer the input gradient
    prompt_length: int = 0  # rows per block of the per-block adapter tensor the request carries (0: none)
    prompt_parts: int = 0  # the messages' tensor parts holding it, after the hidden states' ``parts``
    prompt_kind: str = DEEP_PROMPT  # how the blocks apply it (a deep prompt's vectors, a bottleneck's weights, a LoRA)
    held_adapter: Optional[BlockAdapter] = None  # the adapter the request named by digest, from the server's store
    work: Optional[WorkStamp] = None  # the caller's proof of work, credited by the handler (swarm.server.work_check)

    @property
    def session_id(self) -> str:
        return self.metadata.get("session_id", "")

    @property
    def step(self) -> int:
        return self.metadata.get("step", -1)

    @property
    def prompt_shape(self) -> tuple[int, int, int]:
        return (self.end - self.start, self.prompt_length, self.shape[2])

    @property
    def tokens(self) -> int:
        """Positions the request carries (a backward request's inputs and gradients both count: it computes more)."""
        return self.shape[0] * self.shape[1]


@dataclass
class Received:
    """A whole request, read and validated: what its first part declared, its hidden states and its per-block
    adapter (sent, or held here and named by digest), and what admitting it costs. ``digest`` is the call's digest
    a receipt signs (:mod:`swarm.wire.receipts`); ``reused_fill`` the digest of the fill a reuse read (set when it
    is computed)."""

    declared: Declared
    hidden: torch.Tensor
    adapter: Optional[BlockAdapter]
    held: bool  # an adapter tensor that came with it is now kept for later calls to name
    cost: int  # its price in the compute queue
    digest: bytes = b""
    reused_fill: bytes = b""


class RequestReader:
    """Reads span requests for one server (see the module doc); ``backend`` holds the span."""

    def __init__(self, backend: SpanBackend, *, hidden_size: int, max_batch_tokens: int, wire_dtype: str,
                 request_timeout: float, num_layers: int, max_stream_message_bytes: int,
                 adapter_tensors: Optional[AdapterTensors] = None):
        self.backend, self.num_layers = backend, num_layers
        self.adapter_tensors = adapter_tensors  # adapter tensors received, by digest (None: kept nowhere)
        self.hidden_size, self.max_batch_tokens = hidden_size, max_batch_tokens
        self.wire_dtype, self.request_timeout = wire_dtype, request_timeout
        self.max_stream_message_bytes = max_stream_message_bytes
        self.max_payload_bytes = max_batch_tokens * hidden_size * 4 + PAYLOAD_SLACK_BYTES
        # a first message may also carry a deep prompt, which weighs at most as much as the hidden states
        self.max_first_bytes = 2 * max_batch_tokens * hidden_size * 4 + PAYLOAD_SLACK_BYTES

    async def read(self, requests: AsyncIterable[runtime_pb2.ExpertRequest], peer: str, unary: bool,
                   backward: bool = False) -> Received:
        """The whole request from ``peer``, or the first refusal it earns (a :class:`RemoteError`)."""
        stream = aiter(requests)
        queue = self.backend.queue
        if not unary:  # no stream place for this peer now: refused before its first part is even read
            queue.check_receive(peer)
        first = await self.first_part(stream, peer)
        declared = self.declared(first, unary, peer, backward)
        cost = self.backend.cost(*declared.shape[:2])
        queue.check(peer, cost)  # no room now: refused before the rest is received
        hidden, adapter, held, digests = await self.receive(first, stream, declared, peer, unary, cost)
        received = Received(declared, hidden, adapter, held, cost)
        if not backward and declared.push is None:  # an answered forward call: its receipt names this digest
            received.digest = await self._call_digest(declared, adapter, *digests)
        return received

    @staticmethod
    async def _call_digest(declared: Declared, adapter: Optional[BlockAdapter], hidden_digest: bytes,
                           adapter_digest: Optional[str]) -> bytes:
        """The digest of the call as read (:class:`~swarm.wire.receipts.CallContent`)."""
        if adapter is not None and adapter_digest is None:
            adapter_digest = await asyncio.to_thread(adapter.digest)  # ~1 GB/s: off the loop
        return CallContent(declared.start, declared.end, declared.session_id, declared.step,
                           declared.cache.to_dict() if declared.cache is not None else None,
                           declared.head.to_dict() if declared.head is not None else None,
                           adapter.kind if adapter is not None else None, adapter_digest, hidden_digest).digest()

    def declared(self, first: runtime_pb2.ExpertRequest, unary: bool, peer: str, backward: bool = False
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
        push = parse_push(extra["push"], self.num_layers, end) if "push" in extra else None
        cache = parse_cache(extra["cache"], metadata.get("session_id", ""), length) if "cache" in extra else None
        head = self._head_query(extra, end, batch, length, cache.rows[0] if cache is not None and cache.rows else 0)
        work = parse_work(extra["work"]) if "work" in extra else None
        if unary and push is None:
            self._check_unary_answer([shape], self.wire_dtype, self.backend.dtype)
        return Declared(metadata, start, end, shape, parts, max_bytes, push, head, cache, **prompted, work=work)

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

    def _head_query(self, extra: dict, end: int, batch: int, length: int, first: int) -> Optional[HeadQuery]:
        """The request's head query (on the ``length`` positions sent, from position ``first``): the hop that ends
        at the last block answers it, earlier hops of a pushed pass hand it on."""
        if "head" not in extra:
            return None
        require(end != self.num_layers or self.backend.head is not None, ErrorCode.WRONG_SPAN,
                "this server holds no output head (it was started without --head): ask for hidden states")
        try:
            return HeadQuery.parse(extra["head"], batch, length, self.backend.span.config.vocab_size, first)
        except ValueError as error:
            raise RemoteError(ErrorCode.BAD_REQUEST, str(error)) from None

    async def first_part(self, stream: AsyncIterator[runtime_pb2.ExpertRequest], peer: str
                          ) -> runtime_pb2.ExpertRequest:
        """The request's first part, within the deadline of one stream message: a stream that sends nothing
        holds an open stream until then, no longer."""
        deadline = self.backend.queue.streams.deadline(self.max_stream_message_bytes, self.request_timeout)
        first = await self.within(anext(stream, None), deadline, peer, "its first part")
        require(first is not None, ErrorCode.BAD_REQUEST, "empty request")
        return first

    async def within(self, work: Awaitable[T], deadline: float, peer: str, what: str) -> T:
        """``work`` (reading a stream), or ``incomplete`` when the stream did not deliver ``what`` by ``deadline``:
        the stream is dropped, counted, and its sender loses its record of completed requests."""
        try:
            return await asyncio.wait_for(work, deadline)
        except asyncio.TimeoutError:
            self.backend.queue.stream_dropped(peer)
            raise RemoteError(ErrorCode.INCOMPLETE, f"the request stream did not deliver {what} within {deadline:.1f} "
                              f"s (--receive-timeout, --receive-rate-mb)") from None

    async def receive(self, first: runtime_pb2.ExpertRequest, stream: AsyncIterator[runtime_pb2.ExpertRequest],
                       declared: Declared, peer: str, unary: bool, cost: int
                       ) -> tuple[torch.Tensor, Optional[BlockAdapter], bool, tuple[bytes, Optional[str]]]:
        """The rest of the request's parts, within its declared size and its deadline, decoded: the hidden
        states and the per-block adapter (None when the request has none; the held one when it named it), both
        validated, whether a tensor that came is now kept for later calls to name, and the digests of the hidden
        states as they travelled and of the adapter (when known here already). A stream holds a place among the
        unfinished streams meanwhile (a unary call has nothing more to receive)."""
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
            await self.within(rest(), deadline, peer, f"its {expected} parts")
        require(len(chunks) == expected, ErrorCode.INCOMPLETE, f"stream ended after {len(chunks)} of {expected} parts")
        proto = join_parts(chunks[:declared.parts], declared.parts)
        hidden = decode_tensor(proto)
        validate_hidden(hidden, self.hidden_size, self.max_batch_tokens)
        require(tuple(hidden.shape) == declared.shape, ErrorCode.BAD_REQUEST,
                f"hidden states of shape {tuple(hidden.shape)}, the first part declared {declared.shape}")
        if not declared.prompt_length or declared.held_adapter is not None:
            named = declared.metadata.get("prompt_digest") if declared.held_adapter is not None else None
            return hidden, declared.held_adapter, False, (tensor_digest(proto), named)
        weights = decode_tensor(join_parts(chunks[declared.parts:], declared.prompt_parts))
        adapter = BlockAdapter(declared.prompt_kind, weights)
        validate_adapter(adapter, declared.prompt_shape)
        if self.adapter_tensors is None or not self.adapter_tensors.enabled:
            return hidden, adapter, False, (tensor_digest(proto), None)
        digest = await asyncio.to_thread(adapter.digest)  # ~1 GB/s: off the loop
        return hidden, adapter, self.adapter_tensors.put(digest, adapter, peer), (tensor_digest(proto), digest)
