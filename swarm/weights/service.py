"""Serving a model's bytes to peers that fetch it: the server side of :class:`swarm.weights.wire.WeightService`.

A server serves byte ranges of what it holds (:class:`swarm.weights.holdings.Holdings`: every tensor of a
checkpoint directory, or the tensors it fetched itself) and announces it
(:func:`swarm.weights.records.declare_host`) with its other records.

Every read is bounded: in length (:data:`~swarm.weights.wire.MAX_READ_BYTES`), in count (:class:`ServeLimits`:
reads at once, and the share one peer may hold), in time (a deadline growing with the length), and all reads
together in bandwidth (``--serve-weights-mbps``). Only bytes of held tensors and files are ever read: a request
names a tensor by its place in the manifest, never a path.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import AsyncIterator, Callable, Optional

from hivemind.dht import DHT
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarm.weights.holdings import Holdings
from swarm.weights.records import declare_host
from swarm.weights.wire import FILE, MANIFEST, TENSOR, ReadRequest, WeightService, data_messages
from swarm.wire.encoding import STREAM_CHUNK_BYTES, error_response
from swarm.wire.messages import ErrorCode, RemoteError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeLimits:
    """How much of a server serving weights may take (``--serve-weights-mbps`` sets ``mbps``)."""

    max_reads: int = 16  # reads being streamed at once, over all peers
    peer_share: float = 0.25  # the share of them one peer (libp2p id) may hold
    mbps: float = 0.0  # megabits per second for all reads together; 0: no cap
    min_rate: float = 1 * 2**20  # bytes/s a reader must at least take: a read's deadline is 10 s + length / this

    @property
    def per_peer(self) -> int:
        return max(1, int(self.max_reads * self.peer_share))


class Bandwidth:
    """A token bucket shared by every read: ``take(n)`` waits until ``n`` more bytes fit the cap."""

    def __init__(self, mbps: float):
        self.rate = mbps * 1e6 / 8  # bytes per second
        self.available = 0.0
        self.updated = time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        async with self.lock:  # one waiter at a time: reads share the cap in turn
            now = time.monotonic()
            self.available = min(self.rate, self.available + (now - self.updated) * self.rate)  # 1 s of burst
            self.updated = now
            self.available -= nbytes
            if self.available < 0:
                await asyncio.sleep(-self.available / self.rate)


class WeightServer(WeightService):
    """Serves the byte ranges of one model's held files and tensors (see the module docstring)."""

    def __init__(self, limits: ServeLimits = ServeLimits()):
        self.limits = limits
        self.holdings: Optional[Holdings] = None  # set once known (building a manifest takes a while)
        self.bandwidth = Bandwidth(limits.mbps)
        self.reading: Counter[str] = Counter()  # reads streaming now, by peer
        self.bytes_served = 0
        self.reads_refused = 0

    async def rpc_read(self, request: runtime_pb2.ExpertRequest,
                       context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        peer = str(context.remote_id)
        try:
            read = ReadRequest.parse(request.metadata)
            source = self._locate(read)
            self._admit(peer)
        except RemoteError as error:
            self.reads_refused += 1
            yield error_response(error)
            return
        self.reading[peer] += 1
        try:
            deadline = time.monotonic() + 10.0 + read.length / self.limits.min_rate
            loop = asyncio.get_running_loop()
            for start in range(read.offset, read.offset + read.length, STREAM_CHUNK_BYTES):
                if time.monotonic() > deadline:  # a reader that takes too slowly holds a read place no longer
                    logger.info("weights read by %s past its deadline: stopped", peer)
                    return
                length = min(STREAM_CHUNK_BYTES, read.offset + read.length - start)
                await self.bandwidth.take(length)
                try:
                    chunk = await loop.run_in_executor(None, source, start, length)
                except OSError as error:  # a held file gone or unreadable: said to the reader, logged here
                    logger.warning("cannot read %s %r of model %s: %s", read.kind, read.name, read.model, error)
                    yield error_response(RemoteError(ErrorCode.NO_WEIGHTS, f"cannot read {read.kind} {read.name!r}"))
                    return
                self.bytes_served += len(chunk)
                yield data_messages([chunk])[0]
        finally:
            self.reading[peer] -= 1
            if not self.reading[peer]:
                del self.reading[peer]

    def _admit(self, peer: str) -> None:
        if sum(self.reading.values()) >= self.limits.max_reads:
            raise RemoteError(ErrorCode.BUSY, f"{self.limits.max_reads} weight reads are streaming: try another peer")
        if self.reading[peer] >= self.limits.per_peer:
            raise RemoteError(ErrorCode.BUSY, f"a peer may stream {self.limits.per_peer} weight reads at once here")

    def _locate(self, read: ReadRequest) -> Callable[[int, int], bytes]:
        """A reader of (offset, length) of what a valid request names; :class:`RemoteError` otherwise."""
        holdings = self.holdings
        if holdings is None or read.model != holdings.model_id:
            raise RemoteError(ErrorCode.NO_WEIGHTS, f"this peer does not serve model {read.model}")
        if read.kind == MANIFEST:
            data = holdings.manifest_bytes
            size, source = len(data), lambda offset, length: data[offset:offset + length]
        elif read.kind == FILE and read.name in holdings.files:
            size, source = holdings.manifest.file(read.name).size, partial(_pread, holdings.files[read.name], 0)
        elif read.kind == TENSOR and read.name in holdings.tensors:
            size, source = holdings.manifest.tensors[read.name].size, partial(_pread, *holdings.tensors[read.name])
        else:
            raise RemoteError(ErrorCode.NO_WEIGHTS, f"this peer does not hold {read.kind} {read.name!r}")
        if read.offset + read.length > size:
            raise RemoteError(ErrorCode.BAD_REQUEST, f"bytes {read.offset}:{read.offset + read.length} are beyond "
                              f"the {size} of {read.kind} {read.name!r}")
        return source

    def declare(self, dht: DHT, peer_id: str, subkey: bytes, expiration: float, addresses: list[str]):
        """Store this peer's hosts record (a future), or None while nothing is held yet."""
        holdings = self.holdings
        if holdings is None:
            return None
        holdings.refresh()
        return declare_host(dht, holdings.model_id, holdings.host_record(peer_id, addresses), subkey, expiration,
                            wait=False)

    def start(self, path: Path, on_ready: Callable[[], object] = lambda: None) -> None:
        """Find what this peer can serve of the model at ``path`` (building a directory's manifest hashes every
        byte) in a daemon thread, so that a server stopped meanwhile exits at once; ``on_ready`` then runs on the
        calling event loop (to announce the weights without waiting for the next announcement)."""
        loop = asyncio.get_running_loop()

        def find() -> None:
            try:
                holdings = Holdings.of_model(path)
            except Exception as error:  # a broken checkpoint must not take the server down: it serves no weights
                logger.warning("not serving the weights of %s: %s", path, error)
                return
            if holdings is None:
                return
            self.holdings = holdings
            logger.info("serving the weights of %s as model %s (%d of %d tensors)", path, holdings.model_id,
                        len(holdings.tensors), len(holdings.manifest.tensors))
            try:
                loop.call_soon_threadsafe(on_ready)
            except RuntimeError:  # the server has stopped meanwhile
                pass

        threading.Thread(target=find, name="weights-manifest", daemon=True).start()


def _pread(path: Path, base: int, offset: int, length: int) -> bytes:
    """``length`` bytes at ``base + offset`` of ``path`` (a held file: never a name from the network)."""
    with open(path, "rb") as f:
        return os.pread(f.fileno(), length, base + offset)
