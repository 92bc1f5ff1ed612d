"""Wire format of the forward and expert RPCs: tensors with hivemind's serializer, metadata as msgpack.

A forward request carries hidden states (batch, length, hidden) for a span ``start:end`` of a server. Small
payloads travel as one unary message; larger ones as a stream of parts whose count is announced in the
first part's metadata and checked on arrival (a stream can lose its tail silently on loopback).

An expert request carries token ids (batch, length) int64 and asks a hosted expert model for the
log-probabilities of positions ``start:end``; it is always small, while the answer (positions x vocabulary)
may not be, so it comes back as a stream of parts counted the same way.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

# Unary messages are capped near 2-4 MiB by the daemon; stay well below.
MAX_UNARY_BYTES = 1024 * 1024
STREAM_CHUNK_BYTES = 512 * 1024

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class ErrorCode(str, enum.Enum):
    BAD_REQUEST = "bad_request"  # malformed metadata or tensors
    WRONG_SPAN = "wrong_span"  # this server does not hold the requested blocks
    NO_EXPERT = "no_expert"  # this server does not host the requested expert
    TOO_LARGE = "too_large"  # over the batch-token or payload limit
    NOT_FINITE = "not_finite"  # NaN or infinite values
    BUSY = "busy"  # queue or memory full: route around this server
    SHUTTING_DOWN = "shutting_down"
    HALTED = "halted"
    CACHE_MISS = "cache_miss"  # a reuse request found no cache for its session here: the client fills again
    INCOMPLETE = "incomplete"  # a request's or an answer's stream lost parts on the way: the call is made again once
    INTERNAL = "internal"
    # Raised by the client about a server, never sent on the wire:
    TIMEOUT = "timeout"  # no answer within the request timeout (a hung or overloaded server)
    UNREACHABLE = "unreachable"  # connection refused, lost, or the peer is gone


class RemoteError(Exception):
    """A structured error a server returned (or a client raised about a server)."""

    def __init__(self, code: ErrorCode | str, message: str, peer_id: Optional[str] = None):
        self.code = ErrorCode(code) if code in ErrorCode._value2member_map_ else ErrorCode.INTERNAL
        self.peer_id = peer_id
        super().__init__(f"[{self.code.value}] {message}" + (f" (peer {peer_id})" if peer_id else ""))
        self.message = message


@dataclass
class ForwardRequest:
    start: int
    end: int
    hidden: torch.Tensor
    session_id: str = ""
    step: int = -1
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExpertRequest:
    domain: str
    tokens: torch.Tensor  # (batch, length) token ids
    start: int  # positions whose log-probabilities are wanted: start:end
    end: int
    session_id: str = ""
    step: int = -1


def expert_request_message(request: ExpertRequest) -> runtime_pb2.ExpertRequest:
    """One unary message: token ids travel exactly as int64, uncompressed."""
    tensor = serialize_torch_tensor(request.tokens.detach().long(), runtime_pb2.CompressionType.NONE)
    metadata = {"domain": request.domain, "start": request.start, "end": request.end,
                "session_id": request.session_id, "step": request.step}
    return runtime_pb2.ExpertRequest(uid="expert", tensors=[tensor], metadata=MSGPackSerializer.dumps(metadata))


def encode_tensor(tensor: torch.Tensor, wire_dtype: str = "float32") -> runtime_pb2.Tensor:
    compression = runtime_pb2.CompressionType.FLOAT16 if wire_dtype == "float16" else runtime_pb2.CompressionType.NONE
    return serialize_torch_tensor(tensor.detach().float(), compression)


def wire_chunks(tensor: runtime_pb2.Tensor) -> list[runtime_pb2.Tensor]:
    """The tensor whole when it fits a unary message, else the parts of a stream."""
    if tensor.ByteSize() <= MAX_UNARY_BYTES:
        return [tensor]
    return list(split_for_streaming(tensor, STREAM_CHUNK_BYTES))


def request_parts(request: ForwardRequest, wire_dtype: str = "float32") -> list[runtime_pb2.ExpertRequest]:
    """One part when small, else stream parts; the first part's metadata says how many follow."""
    tensor = encode_tensor(request.hidden, wire_dtype)
    metadata = {"start": request.start, "end": request.end, "session_id": request.session_id,
                "step": request.step, "extra": request.extra}
    chunks = wire_chunks(tensor)
    metadata["parts"] = len(chunks)
    parts = [runtime_pb2.ExpertRequest(uid="forward", tensors=[chunks[0]], metadata=MSGPackSerializer.dumps(metadata))]
    parts += [runtime_pb2.ExpertRequest(tensors=[chunk]) for chunk in chunks[1:]]
    return parts


def parse_metadata(raw: bytes) -> dict[str, Any]:
    try:
        metadata = MSGPackSerializer.loads(raw) if raw else {}
    except Exception as error:  # msgpack raises several unrelated types on garbage
        raise RemoteError(ErrorCode.BAD_REQUEST, f"metadata is not valid msgpack: {error}") from None
    if not isinstance(metadata, dict):
        raise RemoteError(ErrorCode.BAD_REQUEST, "metadata must be a map")
    return metadata


def join_parts(parts: list[runtime_pb2.Tensor], expected: Any, peer_id: Optional[str] = None) -> runtime_pb2.Tensor:
    """Reassemble a streamed tensor, refusing a stream whose part count does not match."""
    if not isinstance(expected, int) or expected < 1:
        raise RemoteError(ErrorCode.BAD_REQUEST, f"metadata 'parts' must be a positive integer, got {expected!r}")
    if len(parts) != expected:
        raise RemoteError(ErrorCode.INCOMPLETE, f"stream ended after {len(parts)} of {expected} parts", peer_id)
    return parts[0] if expected == 1 else combine_from_streaming(parts)


def decode_tensor(proto: runtime_pb2.Tensor) -> torch.Tensor:
    try:
        return deserialize_torch_tensor(proto)
    except Exception as error:  # corrupt buffers raise ValueError, RuntimeError, TypeError...
        raise RemoteError(ErrorCode.BAD_REQUEST, f"cannot decode tensor: {error}") from None


def response_parts(hidden: torch.Tensor, wire_dtype: str, metadata: Optional[dict] = None) -> list[runtime_pb2.ExpertResponse]:
    chunks = wire_chunks(encode_tensor(hidden, wire_dtype))
    meta = dict(metadata or {}, parts=len(chunks))
    parts = [runtime_pb2.ExpertResponse(tensors=[chunks[0]], metadata=MSGPackSerializer.dumps(meta))]
    return parts + [runtime_pb2.ExpertResponse(tensors=[chunk]) for chunk in chunks[1:]]


def error_response(error: RemoteError, metadata: Optional[dict] = None) -> runtime_pb2.ExpertResponse:
    meta = dict(metadata or {}, error={"code": error.code.value, "message": error.message})
    return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps(meta))


def ack_response() -> runtime_pb2.ExpertResponse:
    """The answer to a pushed request: accepted and computed; the output travels on to the next hop."""
    return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"pushed": True}))


def response_metadata(parts: list[runtime_pb2.ExpertResponse], peer_id: Optional[str] = None) -> dict:
    """The first part's metadata; a structured error in it is raised (naming ``failed_peer`` when given)."""
    if not parts:  # hivemind streams on loopback can lose messages, rarely, with several calls in flight
        raise RemoteError(ErrorCode.INCOMPLETE, "empty response", peer_id)
    metadata = parse_metadata(parts[0].metadata)
    check_error(metadata, metadata.get("failed_peer", peer_id))
    return metadata


def collect_ack(parts: list[runtime_pb2.ExpertResponse], peer_id: Optional[str] = None) -> tuple[None, dict]:
    metadata = response_metadata(parts, peer_id)
    if metadata.get("pushed") is not True:
        raise RemoteError(ErrorCode.INTERNAL, "server did not accept the push (an older version?)", peer_id)
    return None, metadata


def check_error(metadata: dict[str, Any], peer_id: Optional[str] = None) -> None:
    error = metadata.get("error")
    if error:
        raise RemoteError(error.get("code", "internal"), str(error.get("message", "unknown error")), peer_id)


def collect_response(parts: list[runtime_pb2.ExpertResponse], peer_id: Optional[str] = None) -> tuple[torch.Tensor, dict]:
    metadata = response_metadata(parts, peer_id)
    tensors = [t for part in parts for t in part.tensors]
    return decode_tensor(join_parts(tensors, metadata.get("parts"), peer_id)), metadata


class FixedNameService(ServicerBase):
    """A service whose handle names are ``swarm.{ClassName}.{method}`` for the declaring class, so an
    implementing subclass and a client's stub agree on them."""

    service_name = ""

    @classmethod
    def _get_handle_name(cls, namespace: Optional[str], method_name: str) -> str:
        name = f"swarm.{cls.service_name}.{method_name}"
        return f"{namespace}::{name}" if namespace else name


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

    async def rpc_expert_logits(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Log-probabilities of a hosted expert (see :class:`ExpertRequest`), streamed as counted parts."""
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
