"""Server-to-server push: after computing its span, a server sends the output straight to the next server
of the client's route, and the last server delivers the final output to the client.

A pass over k servers then crosses the network k + 1 times instead of 2k. The client still hears from the
first server (an acknowledgement), and any hop that cannot reach the next one delivers the error instead,
naming the peer that failed, so the client can route around it.

An output waiting to be handed on holds memory after its request was answered, so pushes have bounds of
their own (:class:`PushLimits`): a place is reserved before the request is computed (refused as busy when
the count, the bytes or the sender's share is taken), and freed once the output is handed on, or dropped
when the next hop or the client does not take it in time.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

from hivemind.p2p import P2P, PeerID
from hivemind.utils.asyncio import iter_as_aiter

from swarm.models.config import ModelConfig
from swarm.server.backend import Admission, Grant
from swarm.server.validation import require
from swarm.wire.encoding import error_response, response_parts, tensor_wire_bytes
from swarm.wire.messages import ErrorCode, ForwardRequest, PushSpec, RemoteError
from swarm.wire.remote import RemoteCaller, as_remote_error
from swarm.wire.services import DeliveryService
from swarm.wire.work import Stamper, stamper_for

logger = logging.getLogger(__name__)

MAX_PUSH_HOPS = 64
MAX_HOP_DELAY = 1.0  # seconds: benchmarks emulate wide-area hops; more is refused
# Wire-sized copies of a pushed output alive while it is sent, beside the float32 tensor until it is encoded:
# the parts, the serialized message and the socket's write buffer.
WIRE_COPIES = 3


@dataclass(frozen=True)
class PushLimits:
    """Bounds on outputs computed for a push and not handed on yet."""

    max_pending: int = 32  # outputs waiting for the next hop or the client
    max_bytes: int = 256 * 2**20  # their memory, counted as :meth:`Pusher.cost` says
    deliver_timeout: float = 10.0  # seconds the client has to take a delivery before it is dropped
    peer_share: float = 1.0  # share of both bounds one sender may hold


def parse_push(raw: Any, num_layers: int, end: int) -> PushSpec:
    """A request's ``extra["push"]``, validated: the route must continue contiguously from this hop's ``end``."""
    require(isinstance(raw, dict), ErrorCode.BAD_REQUEST, "extra['push'] must be a map")
    route = raw.get("route")
    require(isinstance(route, list) and len(route) <= MAX_PUSH_HOPS, ErrorCode.BAD_REQUEST,
            f"push route must be a list of at most {MAX_PUSH_HOPS} hops")
    hops, position = [], end
    for hop in route:
        require(isinstance(hop, list) and len(hop) == 3 and isinstance(hop[0], str)
                and all(isinstance(v, int) for v in hop[1:]), ErrorCode.BAD_REQUEST,
                "each push hop must be [peer_id, start, end]")
        require(hop[1] == position and hop[1] < hop[2] <= num_layers, ErrorCode.BAD_REQUEST,
                f"push hop {hop[1]}:{hop[2]} does not continue the route at block {position}")
        _peer(hop[0])
        hops.append((hop[0], hop[1], hop[2]))
        position = hop[2]
    for key in ("reply_to", "namespace", "id"):
        require(isinstance(raw.get(key), str) and 0 < len(raw[key]) <= 128, ErrorCode.BAD_REQUEST,
                f"push {key!r} must be a non-empty string")
    _peer(raw["reply_to"])
    delay = raw.get("hop_delay", [0.0, 0.0])
    require(isinstance(delay, list) and len(delay) == 2 and all(isinstance(v, (int, float)) for v in delay)
            and all(0 <= v <= MAX_HOP_DELAY for v in delay), ErrorCode.BAD_REQUEST,
            f"push hop_delay must be [latency, jitter], each 0..{MAX_HOP_DELAY} s")
    return PushSpec(tuple(hops), raw["reply_to"], raw["namespace"], raw["id"], (float(delay[0]), float(delay[1])))


def _peer(text: str) -> PeerID:
    try:
        return PeerID.from_base58(text)
    except Exception:
        raise RemoteError(ErrorCode.BAD_REQUEST, f"{text[:60]!r} is not a peer id") from None


class Pusher:
    """Sends outputs onward in the background; the request that produced them has already been answered."""

    def __init__(self, wire_dtype: str, request_timeout: float, limits: PushLimits = PushLimits()):
        self.wire_dtype, self.request_timeout, self.limits = wire_dtype, request_timeout, limits
        self.admission = Admission("pushes", limits.max_pending, limits.max_bytes, "bytes", limits.peer_share,
                                   computes=False)
        self.p2p: Optional[P2P] = None
        self.stamper: Optional[Stamper] = None  # proof of work on each push, for the next hop's fair order
        self.tasks: set[asyncio.Task] = set()
        self.pushed = self.delivered = self.failed = self.dropped = 0

    def attach(self, p2p: P2P, model: Optional[ModelConfig] = None) -> None:
        """Send from ``p2p``; with the ``model``'s config, pushes carry work stamps of this server's for the next hop
        as a client's calls do (the client's stamp named this server, not the next)."""
        self.p2p = p2p
        if model is not None:
            self.stamper = stamper_for(str(p2p.peer_id), model)

    def cost(self, shape: tuple[int, ...]) -> int:
        """Bytes a pushed output of ``shape`` holds at its peak: the tensor and its wire copies."""
        return 4 * math.prod(shape) + WIRE_COPIES * tensor_wire_bytes(shape, self.wire_dtype)

    def reserve(self, peer: str, shape: tuple[int, ...]) -> Grant:
        """A place for the output of a request of ``shape`` from ``peer``, taken before it is computed."""
        require(self.p2p is not None, ErrorCode.SHUTTING_DOWN, "server is not connected yet")
        return self.admission.acquire(peer, self.cost(shape))

    def send(self, computed: ForwardRequest, grant: Grant) -> None:
        """Hand ``computed`` (the pushed request, its ``hidden`` now this hop's output) on in the background;
        ``grant`` (from :meth:`reserve`) is released when it is done."""
        task = asyncio.create_task(self._onward(computed))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(lambda _: grant.release())
        grant.hand_on()

    async def _onward(self, computed: ForwardRequest) -> None:
        spec = computed.push
        caller = RemoteCaller(self.p2p, self.wire_dtype, *spec.hop_delay, stamper=self.stamper)
        if not spec.route:
            parts = response_parts(computed.hidden, self.wire_dtype, {"push_id": spec.push_id})
            del computed  # the wire parts are all that is sent
            await caller.crossing()
            await self._deliver(spec, parts)
            return
        peer, start, end = spec.route[0]
        request = dataclasses.replace(computed, start=start, end=end, push=spec.onward(), work=None)
        del computed
        try:  # the next hop computes before it acknowledges, so it has the request timeout
            await caller.push(peer, request, self.request_timeout)  # delays this crossing and the ack's
            self.pushed += 1
        except RemoteError as error:
            self.failed += 1
            logger.info("push %s to %s failed: %s", spec.push_id[:8], peer[-8:], error)
            failure = error_response(RemoteError(error.code, error.message, retry_after=error.retry_after),
                                     {"push_id": spec.push_id, "failed_peer": peer})
            await self._deliver(spec, [failure])

    async def _deliver(self, spec: PushSpec, parts: list) -> None:
        stub = DeliveryService.get_stub(self.p2p, PeerID.from_base58(spec.reply_to), namespace=spec.namespace)
        try:
            async def call() -> None:
                async for _ in await stub.rpc_deliver(iter_as_aiter(parts)):
                    pass

            await asyncio.wait_for(call(), self.limits.deliver_timeout)
            self.delivered += 1
        except Exception as error:  # the client left, cannot be reached or does not read: it will retry
            self.dropped += 1
            logger.info("dropped push %s to %s: %s", spec.push_id[:8], spec.reply_to[-8:],
                        as_remote_error(error, spec.reply_to))

    def info(self) -> dict:
        return {"pushed": self.pushed, "delivered": self.delivered, "failed": self.failed, "dropped": self.dropped,
                "pending": self.admission.info()}

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
