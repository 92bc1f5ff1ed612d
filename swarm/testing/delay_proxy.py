"""Delaying TCP proxies on 127.0.0.1: a wide-area link without netem or root, for tests and benchmarks.

A :class:`DelayProxy` listens on 127.0.0.1 and forwards every connection to one target port, holding each chunk of
bytes, in each direction, for ``delay`` seconds before passing it on (in order, pipelined: a link of that one-way
delay and unlimited bandwidth). A new connection costs one round trip before its first byte arrives, as a TCP
handshake does. Unlike a delay injected in the client (``ClientConfig.inject_latency``), this delays every
crossing the protocol really makes: connection and stream set-up, DHT lookups, acknowledgements, checks.

Every chunk is written to a shared :class:`CrossingLog`, with the processes at both ends (read from the kernel's
socket table), which answers what a test asks of a window of time (one denoising step): how many connections opened,
and :meth:`CrossingLog.chain`, the longest sequence of crossings each sent by the process the one before it reached,
after it arrived: the crossings the window's work waited for one after the other, which is what a link's delay
multiplies. It is counted from the order of events, not from their durations, so a slow machine does not change it;
traffic that happens to fall between two crossings of a pass at the same process (a server's DHT announcement) can
lengthen it, which is why tests and benchmarks start servers that announce rarely.

:class:`DelayedSwarm` is a :class:`~swarm.utils.local_swarm.LocalSwarm` whose bootstrap peer and servers each sit
behind their own proxy: they listen on a private port and announce the proxy's, so every peer reaches every other
one only through a delayed link.
"""
from __future__ import annotations

import asyncio
import bisect
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import psutil

from swarm.utils.event_loop import BackgroundLoop
from swarm.utils.local_swarm import LocalSwarm, ManagedProcess

logger = logging.getLogger(__name__)

CHUNK_BYTES = 2**16
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Crossing:
    """One chunk of bytes on one connection: read from its sender at ``sent``, passed on at ``arrived``."""

    link: str  # the proxy's name (which peer it fronts)
    connection: int  # numbered per log
    upstream: bool  # towards the proxied peer (False: back to whoever connected)
    sender: str  # the process that wrote it (:func:`process_at`)
    receiver: str
    sent: float  # time.monotonic()
    arrived: float
    size: int


@dataclass
class CrossingLog:
    """Every crossing and connection of a set of proxies (thread-safe); windows of it are read by time."""

    crossings: list[Crossing] = field(default_factory=list)
    opened: list[tuple[str, float, int]] = field(default_factory=list)  # (link, time, number) per accepted one
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _next_connection: int = 0

    def connection(self, link: str) -> int:
        with self._lock:
            self._next_connection += 1
            self.opened.append((link, time.monotonic(), self._next_connection))
            return self._next_connection

    def add(self, crossing: Crossing) -> None:
        with self._lock:
            self.crossings.append(crossing)

    def within(self, start: float, end: float) -> list[Crossing]:
        """Crossings sent and arrived inside ``[start, end]``, by arrival."""
        with self._lock:
            inside = [c for c in self.crossings if c.sent >= start and c.arrived <= end]
        return sorted(inside, key=lambda c: c.arrived)

    def connections(self, start: float, end: float, dialer: Optional[str] = None) -> int:
        """Connections opened inside ``[start, end]`` (by ``dialer`` only, when given: a process)."""
        with self._lock:
            numbers = [number for _, at, number in self.opened if start <= at <= end]
            if dialer is not None:
                dialled = {c.connection for c in self.crossings if c.upstream and c.sender == dialer}
                numbers = [number for number in numbers if number in dialled]
            return len(numbers)

    def chain(self, start: float, end: float, origin: Optional[str] = None) -> int:
        """The longest sequence of crossings inside the window each sent by the process the one before it reached,
        after it arrived there: the one-way delays the window's work waited for one after the other. With
        ``origin`` (a process, :meth:`outsiders`) only chains that leave it and come back to it count: a client's
        step, not the servers' own chatter meanwhile."""
        arrivals: dict[str, list[float]] = {}  # per receiver: arrival times of the crossings seen so far
        best: dict[str, list[int]] = {}  # ... and the longest chain ending with any of them (a running maximum)
        longest = 0
        for crossing in self.within(start, end):  # by arrival: whatever arrived before one was sent comes first
            times, lengths = arrivals.get(crossing.sender, []), best.get(crossing.sender, [])
            before = bisect.bisect_right(times, crossing.sent)
            length = lengths[before - 1] + 1 if before and lengths[before - 1] else int(
                origin is None or crossing.sender == origin)
            previous = best.setdefault(crossing.receiver, [])
            arrivals.setdefault(crossing.receiver, []).append(crossing.arrived)
            previous.append(max(length, previous[-1] if previous else 0))
            if origin is None or crossing.receiver == origin:
                longest = max(longest, length)
        return longest

    def outsiders(self, start: float = 0.0, end: float = float("inf")) -> set[str]:
        """Processes that dialled through a proxy inside the window and sit behind none (a client's)."""
        with self._lock:
            behind = {c.receiver for c in self.crossings if c.upstream}
        return {c.sender for c in self.within(start, end) if c.upstream} - behind

    def steps(self, marks: list[float], origin: Optional[str] = None) -> list[int]:
        """:meth:`chain` of each window between consecutive ``marks`` (a generation's step ends), from and back to
        ``origin`` (:func:`daemon_process` of the client), or else to the window's only outsider when there is one.
        Name the origin where other programs run: a stranger holding a stale address may dial a proxy's port."""
        chains = []
        for start, end in zip(marks, marks[1:]):
            origins = {origin} if origin is not None else self.outsiders(start, end)
            chains.append(self.chain(start, end, next(iter(origins)) if len(origins) == 1 else None))
        return chains


class DelayProxy:
    """Forwards connections on ``HOST:port`` to ``HOST:target``, each chunk delayed ``delay`` s each way (see the
    module doc); runs on the event loop it is started on."""

    def __init__(self, name: str, target: int, delay: float, log: CrossingLog):
        self.name, self.target, self.delay, self.log = name, target, delay, log
        self.port = 0
        self._server: Optional[asyncio.AbstractServer] = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._serve, HOST, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        connection = self.log.connection(self.name)
        opened = time.monotonic() + 2 * self.delay  # the handshake's round trip, before the first byte may go
        up_writer: Optional[asyncio.StreamWriter] = None
        try:
            await asyncio.sleep(self.delay)  # the SYN on its way to the peer
            try:
                up_reader, up_writer = await asyncio.open_connection(HOST, self.target)
            except OSError:
                return
            loop = asyncio.get_running_loop()
            dialer, listener = await asyncio.gather(
                loop.run_in_executor(None, process_at, writer.get_extra_info("peername")[1]),
                loop.run_in_executor(None, process_at, self.target))
            await asyncio.gather(self._pump(reader, up_writer, (connection, True, dialer, listener), opened),
                                 self._pump(up_reader, writer, (connection, False, listener, dialer), opened))
        except asyncio.CancelledError:
            pass
        finally:
            writer.close()
            if up_writer is not None:
                up_writer.close()
            self._tasks.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    way: tuple[int, bool, str, str], opened: float) -> None:
        """Read chunks as they come and write each ``delay`` s after it was read, in order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                item = await queue.get()
                if item is None:
                    break
                sent, due, data = item
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                self.log.add(Crossing(self.name, *way, sent, time.monotonic(), len(data)))
                await writer.drain()
            if writer.can_write_eof():
                try:
                    writer.write_eof()
                except OSError:  # the other side is gone already
                    pass

        delivering = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(CHUNK_BYTES):
                sent = time.monotonic()
                queue.put_nowait((sent, max(sent, opened) + self.delay, data))
        except ConnectionError:
            pass
        finally:
            queue.put_nowait(None)
            try:
                await delivering
            except OSError:  # the receiver left
                pass


def _holder(kind: str, holds: Callable[[Any], bool]) -> Optional[str]:
    """The pid of the process owning a socket of ``kind`` (psutil's) whose local address ``holds``; None if none."""
    try:
        for connection in psutil.net_connections(kind):
            if connection.laddr and connection.pid and holds(connection.laddr):
                return str(connection.pid)
    except psutil.Error:
        pass
    return None


def process_at(port: int) -> str:
    """Which process holds the local end ``HOST:port`` of a TCP socket (its pid; "?port" when it cannot be told)."""
    return _holder("tcp4", lambda address: address.port == port) or f"?{port}"


def daemon_process(p2p) -> str:
    """The process (its pid, as :class:`Crossing` names processes) of the libp2p daemon that a hivemind ``P2P``
    (or its replica) talks through: the one listening on its control socket. That daemon is who dials a proxy for
    a client, so a window's client is known for sure, not guessed as the one outsider: on a busy machine another
    program's peer may hold a stale address whose port a proxy took since, and dial it (CI saw two outsiders)."""
    path = str(p2p.daemon_listen_maddr).split("/unix", 1)[-1]
    pid = _holder("unix", lambda address: address == path)
    if pid is None:
        raise LookupError(f"no process listens on {path}")
    return pid


def free_port() -> int:
    """A port on 127.0.0.1 nobody listens on now."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


class DelayedLinks:
    """Proxies sharing one :class:`CrossingLog`, on a background event loop of their own; ``delay`` may be changed
    between measurements (connections already open take the new delay for their next chunks)."""

    def __init__(self, delay: float):
        self._delay = delay
        self.log = CrossingLog()
        self.proxies: list[DelayProxy] = []
        self.loop = BackgroundLoop("delay-proxies")

    @property
    def delay(self) -> float:
        return self._delay

    @delay.setter
    def delay(self, seconds: float) -> None:
        self._delay = seconds
        for proxy in self.proxies:
            proxy.delay = seconds

    def add(self, name: str, target: int, port: int = 0) -> int:
        """A proxy to ``HOST:target`` named ``name``; returns the port it listens on."""
        proxy = DelayProxy(name, target, self._delay, self.log)
        self.proxies.append(proxy)
        return self.loop.run(proxy.start(port))

    def close(self) -> None:
        for proxy in self.proxies:
            self.loop.run(proxy.close())
        self.loop.stop()


class DelayedSwarm(LocalSwarm):
    """A local swarm whose every peer is reached only through a :class:`DelayProxy` of ``links`` (module doc)."""

    def __init__(self, links: DelayedLinks, **kwargs):
        super().__init__(**kwargs)
        self.links = links

    def _behind_proxy(self, name: str) -> list[str]:
        """Listen on a private port, announce a proxy's."""
        private = free_port()
        public = self.links.add(name, private)
        return ["--host-maddrs", f"/ip4/{HOST}/tcp/{private}", "--announce-maddrs", f"/ip4/{HOST}/tcp/{public}"]

    def start_bootstrap(self) -> ManagedProcess:
        self.bootstrap = self._start("bootstrap", ["-m", "swarm.dht", *self._behind_proxy("bootstrap")])
        return self.bootstrap

    def start_server(self, model: str, blocks: Optional[str] = None, *extra: str, name: Optional[str] = None,
                     wait: bool = True, entry: Sequence[str] = ("-m", "swarm.server")) -> ManagedProcess:
        name = name or f"server-{blocks}"
        return super().start_server(model, blocks, *self._behind_proxy(name), *extra, name=name, wait=wait,
                                    entry=entry)

    @property
    def initial_peers(self) -> list[str]:
        """The bootstrap peer's proxied addresses only (its private one would bypass the delay)."""
        ports = {proxy.port for proxy in self.links.proxies}
        return [m for m in super().initial_peers if any(f"/tcp/{port}/" in m for port in ports)]
