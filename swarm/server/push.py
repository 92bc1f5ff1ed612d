"""Server-to-server push: after computing its span, a server sends the output straight to the next server
of the client's route, and the last server delivers the final output to the client.

A pass over k servers then crosses the network k + 1 times instead of 2k. The client still hears from the
first server (an acknowledgement), and any hop that cannot reach the next one delivers the error instead,
naming the peer that failed, so the client can route around it.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils.asyncio import iter_as_aiter

from swarm.client.remote import RemoteCaller, as_remote_error
from swarm.protocol import DeliveryService, ErrorCode, ForwardRequest, RemoteError, error_response, response_parts
from swarm.server.validation import require

logger = logging.getLogger(__name__)

MAX_PUSH_HOPS = 64
MAX_HOP_DELAY = 1.0  # seconds: benchmarks emulate wide-area hops; more is refused


@dataclass(frozen=True)
class PushSpec:
    """``extra["push"]`` of a request: where its output goes next."""

    route: tuple[tuple[str, int, int], ...]  # (peer id, start, end) of the hops after this one
    reply_to: str  # the client's peer id
    namespace: str  # the client's DeliveryService namespace
    push_id: str
    hop_delay: tuple[float, float] = (0.0, 0.0)  # emulated (latency, jitter) of each crossing

    @classmethod
    def parse(cls, raw: Any, num_layers: int, end: int) -> "PushSpec":
        """Validate the remote description; the route must continue contiguously from this hop's ``end``."""
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
        return cls(tuple(hops), raw["reply_to"], raw["namespace"], raw["id"], (float(delay[0]), float(delay[1])))

    def onward(self) -> dict[str, Any]:
        """The spec the next hop receives: the same, minus that hop."""
        return {"route": [list(hop) for hop in self.route[1:]], "reply_to": self.reply_to,
                "namespace": self.namespace, "id": self.push_id, "hop_delay": list(self.hop_delay)}


def _peer(text: str) -> PeerID:
    try:
        return PeerID.from_base58(text)
    except Exception:
        raise RemoteError(ErrorCode.BAD_REQUEST, f"{text[:60]!r} is not a peer id") from None


class Pusher:
    """Sends outputs onward in the background; the request that produced them has already been answered."""

    def __init__(self, wire_dtype: str, request_timeout: float):
        self.wire_dtype, self.request_timeout = wire_dtype, request_timeout
        self.p2p: Optional[P2P] = None
        self.tasks: set[asyncio.Task] = set()
        self.pushed = self.delivered = self.failed = 0

    def attach(self, p2p: P2P) -> None:
        self.p2p = p2p

    def send(self, spec: PushSpec, output: torch.Tensor, session_id: str, step: int, extra: dict) -> None:
        require(self.p2p is not None, ErrorCode.SHUTTING_DOWN, "server is not connected yet")
        task = asyncio.create_task(self._onward(spec, output, session_id, step, extra))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _onward(self, spec: PushSpec, output: torch.Tensor, session_id: str, step: int, extra: dict) -> None:
        caller = RemoteCaller(self.p2p, self.wire_dtype, *spec.hop_delay)
        if not spec.route:
            await caller.crossing()
            await self._deliver(spec, response_parts(output, self.wire_dtype, {"push_id": spec.push_id}))
            return
        peer, start, end = spec.route[0]
        request = ForwardRequest(start, end, output, session_id, step, dict(extra, push=spec.onward()))
        try:
            await caller.push(peer, request, self.request_timeout)  # delays this crossing and the ack's
            self.pushed += 1
        except RemoteError as error:
            self.failed += 1
            logger.info("push %s to %s failed: %s", spec.push_id[:8], peer[-8:], error)
            failure = error_response(RemoteError(error.code, error.message), {"push_id": spec.push_id, "failed_peer": peer})
            await self._deliver(spec, [failure])

    async def _deliver(self, spec: PushSpec, parts: list) -> None:
        stub = DeliveryService.get_stub(self.p2p, PeerID.from_base58(spec.reply_to), namespace=spec.namespace)
        try:
            async def call() -> None:
                async for _ in await stub.rpc_deliver(iter_as_aiter(parts)):
                    pass

            await asyncio.wait_for(call(), self.request_timeout)
            self.delivered += 1
        except Exception as error:  # the client left or cannot be reached: it will time out and retry
            logger.info("could not deliver push %s to %s: %s", spec.push_id[:8], spec.reply_to[-8:],
                        as_remote_error(error, spec.reply_to))

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
