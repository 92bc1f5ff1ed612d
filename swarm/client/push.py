"""The client's end of server-to-server push: it waits for the route's last server to deliver the output."""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator

from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from swarm.wire.encoding import collect_response, parse_metadata
from swarm.wire.messages import RemoteError
from swarm.wire.services import DeliveryService

logger = logging.getLogger(__name__)

MAX_DELIVERY_PARTS = 512  # parts of one delivered output: 1 GiB at most (a stream message is at most 2 MiB)


@dataclass
class PushStats:
    """What happened to this client's pushed passes, so that a caller (or a test) can tell that push works: a
    pass that fails is redone hop by hop (or, for an error no server can fix, raised) with the same tokens."""

    passes: int = 0  # pushed passes started
    delivered: int = 0  # ... whose output the route's last server delivered
    failed: dict[str, int] = field(default_factory=dict)  # ... for which a hop delivered an error, by error code
    undelivered: int = 0  # ... given up with nothing delivered: no answer in time, or the first server refused
    ignored: int = 0  # deliveries for no pass waiting: late (the pass was redone hop by hop), unknown or forged

    def to_dict(self) -> dict:
        return asdict(self)


class PushReceiver(DeliveryService):
    """Resolves one future per pushed pass when its output (or a hop's error) is delivered; counts each
    outcome in ``stats``. Every method runs on the client's event loop."""

    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        self.namespace = uuid.uuid4().hex  # this client's own handler name on a possibly shared P2P instance
        self.waiting: dict[str, asyncio.Future] = {}
        self.stats = PushStats()

    async def register(self, p2p: P2P) -> None:
        await self.add_p2p_handlers(p2p, namespace=self.namespace)

    def expect(self, push_id: str) -> asyncio.Future:
        """A future for the delivery of ``push_id``; call from the event loop."""
        future = asyncio.get_running_loop().create_future()
        self.waiting[push_id] = future
        self.stats.passes += 1
        return future

    def forget(self, push_id: str) -> None:
        """The pass is over, delivered or not; a delivery arriving later is ignored."""
        future = self.waiting.pop(push_id, None)
        if future is not None and (not future.done() or future.cancelled()):  # a timeout cancels the wait
            self.stats.undelivered += 1

    async def rpc_deliver(
        self, parts: AsyncIterator[runtime_pb2.ExpertResponse], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertUID]:
        received = []
        async for part in parts:
            if len(received) >= MAX_DELIVERY_PARTS:  # a hostile peer cannot make this client hold an endless stream
                logger.warning("refusing a delivery of over %d parts from %s", MAX_DELIVERY_PARTS, context.remote_id)
                yield runtime_pb2.ExpertUID(uid="too_large")
                return
            received.append(part)
        push_id = parse_metadata(received[0].metadata).get("push_id") if received else None
        future = self.waiting.get(push_id) if isinstance(push_id, str) else None
        if future is None or future.done():  # unknown, late (the pass was retried) or forged: ignore it
            self.stats.ignored += 1
            logger.debug("ignoring a delivery for unknown push %r from %s", push_id, context.remote_id)
        else:
            try:
                hidden, _ = collect_response(received, str(context.remote_id))
                future.set_result(hidden)
                self.stats.delivered += 1
            except RemoteError as error:
                future.set_exception(error)
                code = str(getattr(error.code, "value", error.code))
                self.stats.failed[code] = self.stats.failed.get(code, 0) + 1
        yield runtime_pb2.ExpertUID(uid="ok")
