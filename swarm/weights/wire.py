"""The weights RPC on the wire: one request names a byte range of a model's manifest, small file or tensor; the
answer streams those bytes in chunks.

Both sides are bounded: a request may ask for at most :data:`MAX_READ_BYTES`, and a reader (:func:`read_range`)
reads each message through :class:`swarm.wire.streams.BoundedStream` (never more than a message's limit in memory)
and stops, refusing the peer, at the first byte beyond what it asked for or past its deadline.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Union

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from swarm.adapters.block import is_sha256_hex
from swarm.weights.manifest import MAX_MANIFEST_BYTES, MAX_SMALL_FILE_BYTES, MAX_TENSORS, SMALL_FILES
from swarm.wire.encoding import MAX_STREAM_MESSAGE_BYTES, STREAM_CHUNK_BYTES, check_error, parse_metadata
from swarm.wire.messages import ErrorCode, RemoteError
from swarm.wire.services import FixedNameService
from swarm.wire.streams import BoundedStream

logger = logging.getLogger(__name__)

MANIFEST, FILE, TENSOR = "manifest", "file", "tensor"
MAX_READ_BYTES = max(MAX_MANIFEST_BYTES, MAX_SMALL_FILE_BYTES)  # one request; tensor parts are far smaller
MAX_MESSAGES_SLACK = 2  # messages beyond the chunks a range needs that a reader tolerates (none are needed)


class WeightService(FixedNameService):
    """The declaration clients build stubs from; :class:`swarm.weights.service.WeightServer` implements it."""

    service_name = "WeightService"

    async def rpc_read(self, request: runtime_pb2.ExpertRequest,
                       context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Bytes ``offset:offset+length`` of a manifest, file or tensor (see :class:`ReadRequest`)."""
        raise NotImplementedError
        yield  # pragma: no cover


@dataclass(frozen=True)
class ReadRequest:
    """What a read asks for: ``kind`` manifest (name ""), file (a name from the fixed list) or tensor (its place
    in the manifest), and a byte range of it."""

    model: str
    kind: str
    name: Union[str, int]
    offset: int
    length: int

    def message(self) -> runtime_pb2.ExpertRequest:
        return runtime_pb2.ExpertRequest(uid="weights", metadata=MSGPackSerializer.dumps(
            {"model": self.model, "kind": self.kind, "name": self.name, "offset": self.offset,
             "length": self.length}))

    @classmethod
    def parse(cls, raw: bytes) -> "ReadRequest":
        """Check a request from the network; :class:`RemoteError` (bad_request, too_large) otherwise."""
        metadata = parse_metadata(raw)
        model, kind, name = metadata.get("model"), metadata.get("kind"), metadata.get("name")
        offset, length = metadata.get("offset"), metadata.get("length")
        if not is_sha256_hex(model):
            raise RemoteError(ErrorCode.BAD_REQUEST, "a weights request names the model id (64 hex digits)")
        valid_name = {MANIFEST: name == "", FILE: name in SMALL_FILES,
                      TENSOR: isinstance(name, int) and not isinstance(name, bool) and 0 <= name < MAX_TENSORS}
        if not valid_name.get(kind, False):
            raise RemoteError(ErrorCode.BAD_REQUEST, "a weights request reads the manifest, a listed file or a "
                              "tensor by its place in the manifest")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
            raise RemoteError(ErrorCode.BAD_REQUEST, "offset and length must be integers >= 0")
        if length > MAX_READ_BYTES:
            raise RemoteError(ErrorCode.TOO_LARGE, f"a read of {length} bytes is over {MAX_READ_BYTES}")
        return cls(model, kind, name, offset, length)


def data_messages(chunks: list[bytes]) -> list[runtime_pb2.ExpertResponse]:
    return [runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=chunk, dtype="uint8", size=[len(chunk)])])
            for chunk in chunks]


async def read_range(p2p: P2P, peer_id: str, request: ReadRequest, timeout: float) -> bytes:
    """Exactly ``request.length`` bytes from ``peer_id``, or :class:`RemoteError`: the peer's own error, TOO_LARGE
    for a single byte (or message) more than asked, INCOMPLETE for fewer, TIMEOUT past ``timeout`` seconds."""

    async def read() -> bytes:
        name = WeightService._get_handle_name(None, "rpc_read")
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name)
        try:
            await P2P.send_protobuf(request.message(), writer)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
            stream = BoundedStream(reader, runtime_pb2.ExpertResponse, MAX_STREAM_MESSAGE_BYTES)
            data, messages = bytearray(), 0
            most_messages = -(-request.length // STREAM_CHUNK_BYTES) + MAX_MESSAGES_SLACK
            while len(data) < request.length:
                try:
                    message = await stream.next()
                except RemoteError as error:  # the answer's stream was cut: said below, with the count
                    if error.code != ErrorCode.INCOMPLETE:
                        raise
                    message = None
                if message is None:
                    break
                check_error(parse_metadata(message.metadata), peer_id)
                messages += 1
                data += b"".join(tensor.buffer for tensor in message.tensors)
                if len(data) > request.length:
                    raise RemoteError(ErrorCode.TOO_LARGE, f"sent more than the {request.length} bytes asked for",
                                      peer_id)
                if messages > most_messages:
                    raise RemoteError(ErrorCode.TOO_LARGE, f"sent {messages} messages for {request.length} bytes: "
                                      f"an endless stream", peer_id)
            if len(data) != request.length:
                raise RemoteError(ErrorCode.INCOMPLETE, f"ended after {len(data)} of the {request.length} bytes "
                                  f"asked for", peer_id)
            return bytes(data)
        finally:
            writer.close()

    try:
        return await asyncio.wait_for(read(), timeout)
    except RemoteError as error:
        if error.peer_id is None:  # raised by the stream reader: name the peer
            raise RemoteError(error.code, error.message, peer_id) from None
        raise
    except asyncio.TimeoutError:
        raise RemoteError(ErrorCode.TIMEOUT, f"no {request.length} bytes within {timeout:.0f} s", peer_id) from None
    except Exception as error:  # the daemon's errors: the peer is gone, refused the stream, ...
        raise RemoteError(ErrorCode.UNREACHABLE, f"{type(error).__name__}: {str(error)[:200]}", peer_id) from None
