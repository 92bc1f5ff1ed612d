"""Request streams read message by message within bounds (:class:`BoundedStream`): a length prefix over the
bound is refused unread, and an abandoned stream is drained within a byte and time budget."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from google.protobuf.message import DecodeError, Message
from hivemind.p2p import P2P

from swarm.wire.messages import ErrorCode, RemoteError

logger = logging.getLogger(__name__)


# After refusing a stream early, a server reads and discards what the caller still sends, so that the caller
# hears the refusal instead of a broken pipe; within these bounds, else it closes the stream.
DRAIN_BYTES = 128 * 2**20


DRAIN_SECONDS = 10.0


MAX_DRAINING = 64  # streams drained at once in a process


MAX_OPEN_STREAMS = 256  # request streams served at once in a process: each may hold one message being read


class BoundedStream:
    """The request messages of one stream, read when the handler asks for them (nothing is prefetched), each
    refused unread when its length prefix is over ``max_bytes``.

    hivemind's own stream handler reads a message of whatever length its prefix declares into memory, and
    prefetches several, so one forged prefix could make a server hold gigabytes."""

    open = 0  # streams being served in this process
    draining = 0  # ... and being drained (see :meth:`drain`)

    def __init__(self, reader: asyncio.StreamReader, message_type: type[Message], max_bytes: int):
        self.reader, self.message_type, self.max_bytes = reader, message_type, max_bytes
        self.ended = False  # the end-of-stream message was read (or the stream was cut)
        self.unread = 0  # bytes of a refused message still in the stream

    def __aiter__(self) -> "BoundedStream":
        return self

    async def __anext__(self) -> Message:
        message = await self.next()
        if message is None:
            raise StopAsyncIteration
        return message

    async def single(self) -> Message:
        message = await self.next()
        if message is None:
            raise RemoteError(ErrorCode.BAD_REQUEST, "the request stream is empty")
        return message

    async def next(self) -> Optional[Message]:
        """The next message, or None at the end of the stream; :class:`RemoteError` for a bad or cut one."""
        if self.ended:
            return None
        marker, length = await self._header()
        if length > self.max_bytes:
            self.unread = length
            raise RemoteError(ErrorCode.TOO_LARGE, f"a stream message of {length} bytes is over the limit of "
                              f"{self.max_bytes}")
        data = await self._read(length)
        if marker == P2P.ERROR_MARKER:  # hivemind ends a stream with an empty error message
            self.ended = True
            return None
        message = self.message_type()
        try:
            if marker != P2P.MESSAGE_MARKER:
                raise DecodeError(f"unknown marker {marker!r}")
            message.ParseFromString(data)
        except DecodeError as error:
            raise RemoteError(ErrorCode.BAD_REQUEST, f"a stream message is not a valid protobuf: {error}") from None
        return message

    async def drain(self) -> bool:
        """Read and drop the rest of the stream, a chunk at a time, so that a caller still sending hears the
        answer; within DRAIN_BYTES and DRAIN_SECONDS, MAX_DRAINING streams at once. True if it reached the end."""
        if self.ended:
            return True
        if BoundedStream.draining >= MAX_DRAINING:
            return False
        BoundedStream.draining += 1
        deadline, budget = time.monotonic() + DRAIN_SECONDS, DRAIN_BYTES
        try:
            while not self.ended and budget >= self.unread:
                budget -= self.unread
                await asyncio.wait_for(self._skip(self.unread), max(0.0, deadline - time.monotonic()))
                marker, self.unread = await asyncio.wait_for(self._header(), max(0.0, deadline - time.monotonic()))
                if marker == P2P.ERROR_MARKER and self.unread <= self.max_bytes:
                    await self._read(self.unread)
                    self.ended = True
            return self.ended
        except (asyncio.TimeoutError, RemoteError):
            return False
        finally:
            BoundedStream.draining -= 1

    async def _header(self) -> tuple[bytes, int]:
        marker = await self._read(1)
        return marker, int.from_bytes(await self._read(P2P.HEADER_LEN), P2P.BYTEORDER)

    async def _read(self, length: int) -> bytes:
        try:
            return await self.reader.readexactly(length)
        except asyncio.IncompleteReadError:  # the caller left or cut its stream
            self.ended = True
            raise RemoteError(ErrorCode.INCOMPLETE, "the request stream was cut before its end") from None

    async def _skip(self, length: int, chunk: int = 2**16) -> None:
        while length > 0:
            length -= len(await self._read(min(chunk, length)))
        self.unread = 0
