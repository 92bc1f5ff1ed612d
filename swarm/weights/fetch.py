"""Fetching a model's bytes from several peers at once, each part checked against the manifest before it is kept.

Each tensor is asked for part by part (:meth:`TensorEntry.part`), spread over the peers that hold it (fewest
reads in flight first, at most ``max_per_peer`` each, ``max_parallel`` in all). A part whose hash differs from the
manifest's, or an answer longer than asked (or shorter, twice: a stream on loopback may lose a message), bans its
peer for the rest of the fetch and the part is asked of another; a peer that times out or refuses gets a strike
(banned after ``max_strikes``). A part no peer delivers fails the fetch with every peer's reason; the parts
already checked stay in the cache's partial file, so the next attempt (after a crash too) asks only for the others.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from hivemind.p2p import P2P

from swarm.weights.cache import ModelCache, PartialTensor
from swarm.weights.manifest import Manifest, sha256_hex
from swarm.weights.records import HostRecord, WeightsNotServed
from swarm.weights.wire import TENSOR, ReadRequest, read_range
from swarm.wire.messages import ErrorCode, RemoteError
from swarm.wire.remote import RemoteCaller

logger = logging.getLogger(__name__)

# Answers that prove the peer broke the protocol (a peer cannot send a wrong byte or length by accident).
PROTOCOL_VIOLATIONS = (ErrorCode.TOO_LARGE, ErrorCode.INCOMPLETE)
PROGRESS_PERIOD_S = 5.0


@dataclass(frozen=True)
class FetchConfig:
    """Bounds of one fetch."""

    max_parallel: int = 16  # reads in flight at once, over all peers
    max_per_peer: int = 4  # ... to one peer (a server lets one peer hold a quarter of its 16 read places)
    timeout: float = 20.0  # seconds a read may take besides its bytes at min_rate
    min_rate: float = 1 * 2**20  # bytes/s a peer must at least deliver
    max_strikes: int = 3  # timeouts or refusals before a peer is no longer asked
    connect_timeout: float = 10.0

    def read_timeout(self, length: int) -> float:
        return self.timeout + length / self.min_rate


@dataclass
class FetchReport:
    """What a fetch did: bytes per peer, seconds, peers banned and why."""

    bytes_by_peer: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    parts: int = 0
    parts_resumed: int = 0

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_peer.values())


class PeerBook:
    """The hosts of a model, what each holds, and how each has behaved (bans last for the book's life)."""

    def __init__(self, hosts: list[HostRecord], config: FetchConfig):
        self.hosts = {host.peer_id: host for host in hosts}
        self.config = config
        self.active: Counter[str] = Counter()
        self.strikes: Counter[str] = Counter()
        self.banned: dict[str, str] = {}

    def candidates(self, tensor: Optional[int], tried: set[str]) -> list[str]:
        """Peers that may still be asked for this (``tensor`` None: the manifest or a file), least busy first."""
        usable = [peer for peer, host in self.hosts.items() if peer not in self.banned and peer not in tried
                  and (tensor is None or host.holds(tensor))]
        return sorted(usable, key=lambda peer: self.active[peer])

    def punish(self, peer: str, error: RemoteError, wrong_bytes: bool = False) -> None:
        if wrong_bytes or error.code in PROTOCOL_VIOLATIONS:
            if peer not in self.banned:
                logger.warning("banning peer %s for this model: %s", peer, error.message)
            self.banned[peer] = error.message
            return
        self.strikes[peer] += 1
        if self.strikes[peer] >= self.config.max_strikes:
            self.banned[peer] = f"{self.strikes[peer]} failed reads, the last: {error.message}"


class Fetcher:
    """Reads of one model's bytes over ``p2p`` (a DHT peer's P2P instance, on the running loop)."""

    def __init__(self, p2p: P2P, model_id: str, book: PeerBook, config: FetchConfig = FetchConfig()):
        self.p2p, self.model_id, self.book, self.config = p2p, model_id, book, config
        self.slots = asyncio.Semaphore(config.max_parallel)
        self.report = FetchReport()
        self.progress = Progress()

    async def connect(self) -> None:
        """Dial every host at the addresses its record gives (its daemon may not know them otherwise)."""
        caller = RemoteCaller(self.p2p)

        async def dial(host: HostRecord) -> None:
            if host.addresses:
                try:
                    await caller.connect(host.peer_id, list(host.addresses), self.config.connect_timeout)
                except RemoteError as error:
                    logger.debug("cannot dial %s: %s", host.peer_id, error)

        await asyncio.gather(*(dial(host) for host in self.book.hosts.values()))

    async def read_checked(self, request: ReadRequest, sha256: str, tensor: Optional[int], what: str) -> bytes:
        """The bytes ``request`` names from some peer, checked against ``sha256``; :class:`WeightsNotServed` when no
        peer delivers them."""
        tried: dict[str, str] = {}
        asked_again: set[str] = set()  # peers whose answer came short once: libp2p on loopback may lose a message
        while True:
            candidates = [p for p in self.book.candidates(tensor, set(tried))
                          if self.book.active[p] < self.config.max_per_peer]
            if not candidates:
                if self.book.candidates(tensor, set(tried)):  # every usable peer is busy with our reads: wait
                    await asyncio.sleep(0.01)
                    continue
                raise WeightsNotServed(self.nobody(what, tried))
            peer = candidates[0]
            self.book.active[peer] += 1
            try:
                data = await read_range(self.p2p, peer, request, self.config.read_timeout(request.length))
            except RemoteError as error:
                if error.code == ErrorCode.INCOMPLETE and peer not in asked_again:
                    asked_again.add(peer)
                    logger.debug("asking %s again for %s: %s", peer, what, error.message)
                    continue
                self.book.punish(peer, error)
                tried[peer] = error.message
                continue
            finally:
                self.book.active[peer] -= 1
            if await asyncio.get_running_loop().run_in_executor(None, sha256_hex, data) != sha256:
                error = RemoteError(ErrorCode.BAD_REQUEST, f"sent {what} with bytes whose hash differs from the "
                                    f"manifest's", peer)
                self.book.punish(peer, error, wrong_bytes=True)
                tried[peer] = error.message
                continue
            self.report.bytes_by_peer[peer] += len(data)
            return data

    def nobody(self, what: str, tried: dict[str, str]) -> str:
        reasons = [f"{peer}: {reason}" for peer, reason in tried.items()]
        reasons += [f"{peer} (banned earlier): {reason}" for peer, reason in self.book.banned.items()
                    if peer not in tried]
        if not self.book.hosts:
            return f"model {self.model_id}: no peer serves it now (servers of its files announce it)"
        return f"model {self.model_id}: no peer delivered {what} as the manifest says ({'; '.join(reasons[:6])})"

    async def fetch_tensors(self, manifest: Manifest, cache: ModelCache, indices: list[int]) -> FetchReport:
        """Bring tensors ``indices`` into ``cache``, every part checked; parts checked before are not asked again."""
        started = time.monotonic()
        partials: dict[int, PartialTensor] = {}
        try:
            for i in indices:  # one by one: those opened are closed below even if the disk fills meanwhile
                partials[i] = cache.partial(manifest, i)
            jobs = [self._part(manifest, partials[i], i, k) for i in indices for k in partials[i].missing]
            self.progress.start(sum(manifest.tensors[i].part(k)[1] for i in indices for k in partials[i].missing))
            self.report.parts += len(jobs)
            self.report.parts_resumed += sum(len(p.verified) for p in partials.values())
            tasks = [asyncio.ensure_future(job) for job in jobs]
            try:
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            loop = asyncio.get_running_loop()
            for i, partial in partials.items():
                await loop.run_in_executor(None, partial.finish, cache.tensor_path(manifest, i))
        finally:
            for partial in partials.values():
                partial.close()
        self.report.seconds += time.monotonic() - started
        return self.report

    async def _part(self, manifest: Manifest, partial: PartialTensor, index: int, part: int) -> None:
        entry = manifest.tensors[index]
        start, length = entry.part(part)
        request = ReadRequest(self.model_id, TENSOR, index, start, length)
        async with self.slots:
            data = await self.read_checked(request, entry.parts[part], index,
                                           f"part {part} of tensor {entry.name}")
        await asyncio.get_running_loop().run_in_executor(None, partial.write, part, data)
        self.progress.add(len(data))


class Progress:
    """A log line every :data:`PROGRESS_PERIOD_S` seconds while a fetch runs: bytes so far, of how many, and rate."""

    def __init__(self) -> None:
        self.total = self.done = 0
        self.started = self.logged = time.monotonic()

    def start(self, total: int) -> None:
        self.total, self.done = total, 0
        self.started = self.logged = time.monotonic()

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now - self.logged >= PROGRESS_PERIOD_S and self.done < self.total:
            self.logged = now
            logger.info("fetched %.0f of %.0f MB (%.0f%%, %.1f MB/s)", self.done / 1e6, self.total / 1e6,
                        100 * self.done / max(self.total, 1), self.done / 1e6 / max(now - self.started, 1e-6))
