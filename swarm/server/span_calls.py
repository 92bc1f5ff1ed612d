"""Computing and answering span calls, once read (:mod:`swarm.server.request_reader`) and admitted.

A forward call runs the span, filling or reusing the session's activation cache, and answers its output (or a head
server's predictions), or hands it on to the next hop of a pushed route. A backward call recomputes the span with
autograd and answers the gradient of its input (and of its per-block adapter's slice). A pass whose caller stopped
waiting is cancelled between blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Callable, Optional

import torch
from hivemind.proto import runtime_pb2

from swarm.diffusion.pipeline import CacheDirective
from swarm.models.kv_cache import CacheMiss, SpanKV
from swarm.server.backend import Grant, SpanBackend, SpanCall
from swarm.server.push import Pusher
from swarm.server.request_reader import Declared, Received
from swarm.server.session_cache import SessionCaches
from swarm.wire.encoding import AUTO_WIRE, ack_response, response_parts
from swarm.wire.messages import ErrorCode, ForwardRequest, RemoteError
from swarm.wire.receipts import ReceiptSigner, tensor_digest

Answer = list[runtime_pb2.ExpertResponse]


def answer_note(received: Received, place: Optional[Grant], floor: Optional[int] = None) -> dict:
    """The answer's metadata: whether an adapter tensor that came is kept for later calls to name, whether the
    request waited for another caller's pass (``contended``: its caller's stamps then buy it a turn of its own, so
    a client stamps its calls to a server while it says so: swarm.wire.work), and the bits a stamp must prove more
    than to be credited (``floor``, when raised: swarm.server.work_check)."""
    note = {"prompt_held": True} if received.held else {}
    if place is not None and place.contended:
        note["contended"] = True
    if floor is not None:
        note["floor"] = floor
    return note


class ForwardCalls:
    """Forward calls: the span's output, the session's cache filled or reused, answered or pushed on."""

    def __init__(self, backend: SpanBackend, pusher: Pusher, caches: Optional[SessionCaches], *, num_layers: int,
                 wire_dtype: str, request_timeout: float, receipts: Optional[ReceiptSigner] = None):
        self.backend, self.pusher, self.caches = backend, pusher, caches
        self.num_layers, self.wire_dtype, self.request_timeout = num_layers, wire_dtype, request_timeout
        self.receipts = receipts  # signs every answered call (None: answers carry no receipt)

    def push_place(self, peer: str, declared: Declared) -> contextlib.AbstractContextManager[Optional[Grant]]:
        """A place in the push budget for a pushed request's output (nothing for other requests)."""
        if declared.push is None:
            return contextlib.nullcontext()
        return self.pusher.reserve(peer, declared.shape)

    async def compute(self, received: Received, place: Grant) -> torch.Tensor:
        """Run the span under ``place`` (the compute queue releases it when the work leaves its thread),
        filling or reusing the session's cache as the request says."""
        declared, hidden = received.declared, received.hidden
        session_id = declared.session_id
        head = declared.head if declared.end == self.num_layers else None  # earlier hops answer hidden states
        try:  # no cache for this session here, or one filled for another batch or blocks: the client refills
            kv, rows, fill = await self._cache_for(declared.cache, session_id, hidden, declared.start, declared.end)
            if kv is not None and fill is not None:
                kv.source = received.digest
            elif kv is not None:
                received.reused_fill = kv.source
            computed = False
            try:
                call = SpanCall(hidden, declared.start, declared.end, kv, rows, head, received.adapter)
                output = await asyncio.wait_for(self.backend.forward(call, grant=place), self.request_timeout)
                computed = True
            finally:
                if fill is not None:  # reuses waiting for this fill go on (or miss, when it failed)
                    self.caches.filled(session_id, fill, kv, ok=computed)
        except CacheMiss as miss:
            raise RemoteError(ErrorCode.CACHE_MISS, str(miss)) from None
        return output

    def answer(self, received: Received, output: torch.Tensor, push_place: Optional[Grant],
               place: Optional[Grant] = None, floor: Optional[int] = None) -> Answer:
        """The output's parts, or, for a pushed request, an acknowledgement while the output goes on (``place``: the
        request's place in the compute queue, and ``floor`` the stamps' floor, for :func:`answer_note`)."""
        declared = received.declared
        if declared.push is None:
            return response_parts(output, self.wire_dtype, answer_note(received, place, floor),
                                  receipt=self._receipt(received))
        self.pusher.send(ForwardRequest(declared.start, declared.end, output, declared.session_id, declared.step,
                                        cache=declared.cache, head=declared.head, push=declared.push), push_place)
        return [ack_response(answer_note(received, place, floor))]

    def _receipt(self, received: Received) -> Optional[Callable[[runtime_pb2.Tensor], dict]]:
        """What signs the answer's receipt once its tensor is encoded (None when this server signs none)."""
        if self.receipts is None:
            return None
        return lambda answer: {"receipt": self.receipts.sign(received.digest, tensor_digest(answer),
                                                             received.reused_fill).to_wire()}

    async def _cache_for(self, directive: Optional[CacheDirective], session_id: str, hidden: torch.Tensor,
                         start: int, end: int
                         ) -> tuple[Optional[SpanKV], Optional[tuple[int, int]], Optional[int]]:
        """The session cache a request fills (``directive.rows`` None) or reuses (rows a:b), the rows it computes,
        and the version it fills (None for a reuse or an uncached request)."""
        if directive is None:
            return None, None, None
        if self.caches is None:
            raise CacheMiss("this server keeps no activation cache")
        if directive.fill:
            batch, length = hidden.shape[:2]
            kv = self.caches.for_fill(session_id, directive.version, directive.keep_from, end - start, batch, length)
            return kv, None, directive.version
        kv = await self.caches.for_reuse(session_id, directive.version)
        return kv, directive.rows, None



class BackwardCalls:
    """Backward calls: the gradient of the span's input, and of the adapter's slice when one came."""

    def __init__(self, backend: SpanBackend, request_timeout: float):
        self.backend, self.request_timeout = backend, request_timeout

    async def compute(self, received: Received, place: Grant) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The gradients from the stacked inputs and output gradients, under ``place``."""
        declared = received.declared
        inputs, grad_outputs = received.hidden.chunk(2)
        call = SpanCall(inputs, declared.start, declared.end, adapter=received.adapter)
        return await asyncio.wait_for(self.backend.backward(call, grad_outputs, grant=place), self.request_timeout)

    @staticmethod
    def answer(received: Received, grads: tuple[torch.Tensor, Optional[torch.Tensor]],
               push_place: Optional[Grant] = None, place: Optional[Grant] = None, floor: Optional[int] = None
               ) -> Answer:
        """Gradients travel in float32, unrounded."""
        grad_input, grad_weights = grads
        return response_parts(grad_input, AUTO_WIRE, answer_note(received, place, floor), second=grad_weights)
