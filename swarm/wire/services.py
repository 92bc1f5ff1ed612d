"""The RPC services a server declares (span calls, pushed deliveries), with fixed handle names that a client's
stub and an implementing subclass agree on; their stream RPCs read requests through :class:`BoundedStream`."""
from __future__ import annotations

import asyncio
import logging
from contextlib import closing
from typing import Any, AsyncIterator, Callable, Optional

from google.protobuf.message import Message
from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2

from swarm.wire.encoding import MAX_STREAM_MESSAGE_BYTES, _send_error
from swarm.wire.messages import ErrorCode, RemoteError
from swarm.wire.streams import MAX_OPEN_STREAMS, BoundedStream

logger = logging.getLogger(__name__)


class FixedNameService(ServicerBase):
    """A service whose handle names are ``swarm.{ClassName}.{method}`` for the declaring class, so an
    implementing subclass and a client's stub agree on them. Its stream RPCs read requests through
    :class:`BoundedStream`."""

    service_name = ""
    max_stream_message_bytes = MAX_STREAM_MESSAGE_BYTES

    @classmethod
    def _get_handle_name(cls, namespace: Optional[str], method_name: str) -> str:
        name = f"swarm.{cls.service_name}.{method_name}"
        return f"{namespace}::{name}" if namespace else name

    async def add_p2p_handlers(self, p2p: P2P, wrapper: Any = None, *, namespace: Optional[str] = None,
                               balanced: bool = False) -> None:
        """hivemind's registration, except that stream RPCs get :meth:`_stream_handler`."""
        self._collect_rpc_handlers()
        servicer = self if wrapper is None else wrapper
        for rpc in self._rpc_handlers:
            name = self._get_handle_name(namespace, rpc.method_name)
            method = getattr(servicer, rpc.method_name)
            if rpc.stream_input or rpc.stream_output:
                handler = self._stream_handler(p2p, name, method, rpc.request_type, rpc.stream_input)
                await p2p.add_binary_stream_handler(name, handler, balanced)
            else:
                await p2p.add_protobuf_handler(name, method, rpc.request_type, balanced=balanced)

    def _stream_handler(self, p2p: P2P, name: str, method: Callable, request_type: type[Message],
                        stream_input: bool) -> Callable:
        """Serve one stream: requests read through :class:`BoundedStream`, answers written as hivemind's
        stubs expect them, then whatever the caller still sends is drained."""

        async def handle(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with closing(writer):
                if BoundedStream.open >= MAX_OPEN_STREAMS:
                    logger.warning("refused a stream from %s: %d streams open", info.peer_id, BoundedStream.open)
                    await _send_error(writer, RemoteError(ErrorCode.BUSY, "server busy: too many open streams"))
                    return
                BoundedStream.open += 1
                try:
                    await serve(info, reader, writer)
                finally:
                    BoundedStream.open -= 1

        async def serve(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=info.peer_id)
            requests = BoundedStream(reader, request_type, self.max_stream_message_bytes)
            try:
                async for response in method(requests if stream_input else await requests.single(), context):
                    await P2P.send_protobuf(response, writer)
            except Exception as error:  # a refused stream, a caller that left, or a failed handler
                logger.debug("stream %s from %s ended: %r", name, info.peer_id, error)
                if not await _send_error(writer, error):
                    return  # the caller is gone
            await requests.drain()

        return handle


class SpanService(FixedNameService):
    """The RPCs every server offers, declared once: hivemind builds client stubs from these signatures.

    The bodies never run: servers override every method (swarm.server.handler.ForwardHandler), clients only
    call ``SpanService.get_stub(p2p, peer)``, so the client does not import server code.
    """

    service_name = "SpanService"

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        raise NotImplementedError

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        raise NotImplementedError

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover  (makes this an async generator, as the stream RPC must be)

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest,
                           context: P2PContext) -> runtime_pb2.ExpertResponse:
        """The gradient of a span's input (see :class:`BackwardRequest`), when it fits one message."""
        raise NotImplementedError

    async def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover

    async def rpc_expert_logits(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Log-probabilities of a hosted expert (see :class:`ExpertQuery`), streamed as counted parts."""
        raise NotImplementedError
        yield  # pragma: no cover

    async def rpc_adapter_files(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The files of a served adapter, by content hash (see :func:`adapter_request`), streamed as counted
        parts."""
        raise NotImplementedError
        yield  # pragma: no cover


class DeliveryService(FixedNameService):
    """The RPC a client offers when it asks for server-to-server push: the route's last server delivers the
    output here (or the hop that failed delivers the error, with ``failed_peer`` in the metadata).

    Each client registers it under its own namespace, sent with the push, so several clients can share one
    P2P instance. The parts are those of a forward response, plus ``push_id`` in the first part's metadata.
    """

    service_name = "DeliveryService"

    async def rpc_deliver(
        self, parts: AsyncIterator[runtime_pb2.ExpertResponse], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertUID]:
        raise NotImplementedError
        yield  # pragma: no cover


class EvidenceService(FixedNameService):
    """The RPC an auditor offers for clients' evidence (issue 55): a client streams one piece of evidence, a header
    then its bytes (:mod:`swarm.wire.handoff`), and hears whether it was queued for recomputation
    (:class:`swarm.audit.handoff.EvidenceInbox` implements it)."""

    service_name = "EvidenceService"

    async def rpc_hand_evidence(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover
