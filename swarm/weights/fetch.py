"""Fetching a model's bytes from several peers at once, each part checked against the manifest before it is kept.

Each tensor is asked for part by part (:meth:`TensorEntry.part`), spread over the peers that hold it (fewest
reads in flight first, at most ``max_per_peer`` each, ``max_parallel`` parts in all). A peer is punished only for
what it could have done right on its own terms:

* bytes whose hash differs from an already verified manifest's, or an answer longer than asked (or shorter,
  twice: a stream on loopback may lose a message), ban it for the rest of the fetch; the part is asked of another;
* the manifest itself is asked of each host at the size *its own* record claims: a host whose bytes of that size
  do not hash to the model id is banned, but a size claimed by anyone else (another host's record, the name's
  record) is only a hint that orders the hosts and never bans one (issue 48: two strangers' records claiming a
  size one byte short banned the honest host);
* a timeout or a refusal is a strike (banned after ``max_strikes``); a busy answer is none (the peer rests a
  moment before this part is asked of it again, a bounded number of times).

Slow peers are measured, hedged and dropped (issue 48's tarpits): each read's bytes/s is kept per peer; a read
still running after :meth:`FetchConfig.hedge_bound` (``hedge_factor`` times what the measured peers would take,
at least ``hedge_after`` seconds) has its part asked of another peer too, the first checked answer wins and the
other read is cancelled; a peer outraced so is *dropped*: asked again only when no other peer holds the part.
So a tarpit costs at most one hedge bound for the reads it held when it was first outraced.

A part no peer delivers fails the fetch with every peer's reason; the parts already checked stay in the cache's
partial file, so the next attempt (after a crash too) asks only for the others.
"""
from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from hivemind.p2p import P2P

from swarm.weights.cache import ModelCache, PartialTensor
from swarm.weights.manifest import Manifest, sha256_hex
from swarm.weights.records import HostRecord, WeightsNotServed
from swarm.weights.wire import MANIFEST, TENSOR, ReadRequest, read_range
from swarm.wire.messages import ErrorCode, RemoteError
from swarm.wire.remote import RemoteCaller

logger = logging.getLogger(__name__)

# Answers that prove the peer broke the protocol (a peer cannot send a wrong byte or length by accident).
PROTOCOL_VIOLATIONS = (ErrorCode.TOO_LARGE, ErrorCode.INCOMPLETE)
PROGRESS_PERIOD_S = 5.0
MAX_BUSY_PER_PART = 10  # busy answers from one peer before a part is no longer asked of it (no strike)
BUSY_PAUSE_S, MAX_BUSY_PAUSE_S = 0.05, 0.5  # ... pausing this long times the count (at most) before asking again
MAX_RACING = 3  # reads of one part in flight at once: the first, and a hedge when the newest is slow too


@dataclass(frozen=True)
class FetchConfig:
    """Bounds of one fetch."""

    max_parallel: int = 16  # parts in flight at once, over all peers (a hedged part holds one place)
    max_per_peer: int = 4  # reads in flight to one peer (a server lets one peer hold a quarter of its 16 read places)
    timeout: float = 20.0  # seconds a read may take besides its bytes at min_rate
    min_rate: float = 1 * 2**20  # bytes/s a peer must at least deliver
    max_strikes: int = 3  # timeouts or refusals before a peer is no longer asked
    connect_timeout: float = 10.0
    hedge_after: float = 2.0  # seconds a read runs at least before its part is asked of another peer too
    hedge_factor: float = 4.0  # ... and at least this many times what the measured peers take for its length

    def read_timeout(self, length: int) -> float:
        return self.timeout + length / self.min_rate


@dataclass
class FetchReport:
    """What a fetch did: bytes per peer, seconds, hedged reads, peers dropped as slow."""

    bytes_by_peer: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    parts: int = 0
    parts_resumed: int = 0
    hedges: int = 0  # reads asked of a second peer because the first was slow
    hedges_won: int = 0  # ... of which the second peer answered first

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_peer.values())


@dataclass(eq=False)
class Attempt:
    """One read of a part in flight: whom it asks, since when, and after how long it is asked elsewhere too."""

    peer: str
    started: float
    bound: float


class PeerBook:
    """The hosts of a model, what each holds, how fast each has been, and how each has behaved (bans and drops
    last for the book's life)."""

    def __init__(self, hosts: list[HostRecord], config: FetchConfig):
        self.hosts = {host.peer_id: host for host in hosts}
        self.config = config
        self.active: Counter[str] = Counter()
        self.strikes: Counter[str] = Counter()
        self.banned: dict[str, str] = {}
        self.dropped: dict[str, str] = {}  # outraced by another peer: asked only when no other holds the part
        self.running: dict[str, set[Attempt]] = {}  # reads in flight, by peer
        self.delivered: Counter[str] = Counter()  # bytes of checked reads, and their seconds: the measured rate
        self.seconds: Counter[str] = Counter()

    def candidates(self, tensor: Optional[int], tried: set[str], among: Optional[set[str]] = None,
                   later: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """Peers that may be asked for this now (``tensor`` None: the manifest or a file), least busy then fastest
        first; the dropped ones, and those with a read past its hedge bound, only when no other remains (``later``:
        peers not to ask now, that still remain)."""
        usable = [peer for peer, host in self.hosts.items() if peer not in self.banned and peer not in tried
                  and (among is None or peer in among) and (tensor is None or host.holds(tensor))]
        now = time.monotonic()
        prompt = [peer for peer in usable if peer not in self.dropped and not self.overdue(peer, now)]
        chosen = [peer for peer in (prompt or usable) if peer not in later]
        return sorted(chosen, key=lambda peer: (self.active[peer], -self.rate(peer)))

    def overdue(self, peer: str, now: float) -> bool:
        """Whether a read of ours from ``peer`` is running past its hedge bound (a peer slow now)."""
        return any(now - attempt.started >= attempt.bound for attempt in self.running.get(peer, ()))

    def rate(self, peer: str) -> float:
        """Bytes/s ``peer``'s checked reads came at (0 when none yet)."""
        seconds = self.seconds[peer]
        return self.delivered[peer] / seconds if seconds > 0 else 0.0

    def measure(self, peer: str, nbytes: int, seconds: float) -> None:
        self.delivered[peer] += nbytes
        self.seconds[peer] += max(seconds, 1e-6)

    def typical_rate(self) -> Optional[float]:
        """The median of the measured peers' rates (None before any checked read)."""
        rates = [self.rate(peer) for peer in self.delivered if self.seconds[peer] > 0]
        return statistics.median(rates) if rates else None

    def drop(self, peer: str, reason: str) -> None:
        if peer not in self.dropped and peer not in self.banned:
            logger.info("dropping slow peer %s for this model: %s", peer, reason)
            self.dropped[peer] = reason

    def punish(self, peer: str, error: RemoteError, wrong_bytes: bool = False) -> None:
        if wrong_bytes or error.code in PROTOCOL_VIOLATIONS:
            if peer not in self.banned:
                logger.warning("banning peer %s for this model: %s", peer, error.message)
            self.banned[peer] = error.message
            return
        self.strikes[peer] += 1
        if self.strikes[peer] >= self.config.max_strikes:
            self.banned[peer] = f"{self.strikes[peer]} failed reads, the last: {error.message}"


@dataclass
class Tries:
    """What the reads of one part have met: peers not to ask again for it (and why), peers asked again after a
    short answer, and peers resting after a busy answer (no fault: asked again after a pause, a bounded number of
    times)."""

    tried: dict[str, str] = field(default_factory=dict)
    asked_again: set[str] = field(default_factory=set)  # libp2p on loopback may lose a message: asked once more
    busy: Counter = field(default_factory=Counter)
    resting: dict[str, float] = field(default_factory=dict)  # peer -> when it may be asked again

    def rest(self, peer: str, reason: str) -> None:
        self.busy[peer] += 1
        if self.busy[peer] >= MAX_BUSY_PER_PART:
            self.tried[peer] = f"busy {self.busy[peer]} times: {reason}"
        else:
            self.resting[peer] = time.monotonic() + min(BUSY_PAUSE_S * self.busy[peer], MAX_BUSY_PAUSE_S)

    def resting_now(self, now: float) -> set[str]:
        return {peer for peer, until in self.resting.items() if until > now}

    def rest_left(self, now: float) -> float:
        return max(0.01, min((until - now for until in self.resting.values() if until > now), default=0.01))


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

    def hedge_bound(self, length: int) -> float:
        """Seconds a read of ``length`` bytes may run before its part is asked of another peer too."""
        typical = self.book.typical_rate()
        expected = length / typical if typical else 0.0
        return max(self.config.hedge_after, self.config.hedge_factor * expected)

    async def read_manifest(self, hinted: Optional[int] = None) -> bytes:
        """The manifest's bytes, hashing to the model id. Each host is asked for the size its own record claims
        (what it could deliver on its own terms: a host whose bytes of that size hash otherwise is banned); the
        hosts whose claim is ``hinted`` (the name record's size) come first, then the sizes most hosts claim.
        Neither hint bans anyone: a host is never asked for a size another peer claimed."""
        claims = Counter(host.manifest_bytes for host in self.book.hosts.values())
        sizes = sorted(claims, key=lambda size: (size != hinted, -claims[size], size))
        failures: list[str] = []
        for size in sizes:
            among = {peer for peer, host in self.book.hosts.items() if host.manifest_bytes == size}
            try:
                return await self.read_checked(ReadRequest(self.model_id, MANIFEST, "", 0, size), self.model_id,
                                               None, f"the manifest ({size} bytes, as its own record says)", among)
            except WeightsNotServed as error:
                failures.append(str(error))
        raise WeightsNotServed("; ".join(failures[:4]) or self.nobody("the manifest", {}))

    async def read_checked(self, request: ReadRequest, sha256: str, tensor: Optional[int], what: str,
                           among: Optional[set[str]] = None) -> bytes:
        """The bytes ``request`` names from some peer (of ``among``, if given), checked against ``sha256``;
        :class:`WeightsNotServed` when no peer delivers them. A read still running after :meth:`hedge_bound` is
        raced against the same read from another peer."""
        tries = Tries()
        racing: dict[asyncio.Task, Attempt] = {}
        bound = self.hedge_bound(request.length)
        try:
            while True:
                now = time.monotonic()
                busy = {attempt.peer for attempt in racing.values()}
                newest = max((attempt.started for attempt in racing.values()), default=now)
                may_start = not racing or (len(racing) < MAX_RACING and now - newest >= bound)
                others = self.book.candidates(tensor, set(tries.tried), among, tries.resting_now(now) | busy)
                if may_start:
                    free = [peer for peer in others if self.book.active[peer] < self.config.max_per_peer]
                    if free:
                        if racing:
                            self.report.hedges += 1
                            logger.debug("asking %s for %s too: %s is slow", free[0], what, sorted(busy))
                        attempt = Attempt(free[0], time.monotonic(), bound)
                        racing[self._start(attempt, request)] = attempt
                        continue
                    if not racing:
                        resting = self.book.candidates(tensor, set(tries.tried), among)
                        if not others and not resting:
                            raise WeightsNotServed(self.nobody(what, tries.tried))
                        await asyncio.sleep(0.01 if others else tries.rest_left(now))  # our reads, or busy peers
                        continue
                if len(racing) >= MAX_RACING or not others:
                    timeout = None  # wait for an answer: nobody else to ask
                elif may_start:
                    timeout = 0.05  # a hedge is due and the peers to ask are busy: look again in a moment
                else:
                    timeout = newest + bound - now
                done, _ = await asyncio.wait(racing, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    attempt = racing.pop(task)
                    data = await self._checked(task, attempt, sha256, what, tries)
                    if data is not None:
                        self._won(attempt, racing, len(data))
                        return data
        finally:
            for task in racing:
                task.cancel()
            await asyncio.gather(*racing, return_exceptions=True)

    def _start(self, attempt: Attempt, request: ReadRequest) -> asyncio.Task:
        """The read as a task, counted in the book at once (the next part's choice sees it) until it ends."""
        peer = attempt.peer
        self.book.active[peer] += 1
        self.book.running.setdefault(peer, set()).add(attempt)

        def ended(_: asyncio.Task) -> None:
            self.book.active[peer] -= 1
            self.book.running[peer].discard(attempt)

        task = asyncio.ensure_future(read_range(self.p2p, peer, request, self.config.read_timeout(request.length)))
        task.add_done_callback(ended)
        return task

    async def _checked(self, task: asyncio.Task, attempt: Attempt, sha256: str, what: str,
                       tries: "Tries") -> Optional[bytes]:
        """The answer of a finished read if its bytes hash to ``sha256``; None otherwise (its peer punished for
        what it did wrong, or resting after a busy answer)."""
        peer = attempt.peer
        try:
            data = task.result()
        except RemoteError as error:
            if error.code == ErrorCode.INCOMPLETE and peer not in tries.asked_again:
                tries.asked_again.add(peer)  # asked again: not added to ``tried``
                logger.debug("asking %s again for %s: %s", peer, what, error.message)
            elif error.code == ErrorCode.BUSY:  # its read places are full (ours may not have ended there yet)
                tries.rest(peer, error.message)
            else:
                self.book.punish(peer, error)
                tries.tried[peer] = error.message
            return None
        if await asyncio.get_running_loop().run_in_executor(None, sha256_hex, data) != sha256:
            error = RemoteError(ErrorCode.BAD_REQUEST, f"sent {what} with bytes whose hash differs from the "
                                f"manifest's", peer)
            self.book.punish(peer, error, wrong_bytes=True)
            tries.tried[peer] = error.message
            return None
        self.book.measure(peer, len(data), time.monotonic() - attempt.started)
        self.report.bytes_by_peer[peer] += len(data)
        return data

    def _won(self, winner: Attempt, racing: dict[asyncio.Task, Attempt], nbytes: int) -> None:
        """Drop the peers whose reads of this part started before the winner's and are still running."""
        for attempt in racing.values():
            if attempt.started < winner.started:
                self.report.hedges_won += 1
                self.book.drop(attempt.peer, f"a read of {nbytes} bytes ran {time.monotonic() - attempt.started:.1f} "
                               f"s while {winner.peer} delivered it in {time.monotonic() - winner.started:.1f} s")

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
