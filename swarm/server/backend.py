"""The compute side of a server: a loaded span, run on a worker thread, with bounded and fair admission.

A request holds two kinds of place, each bounded in count and cost: while its stream's parts arrive, one of the
*unfinished streams* (also bounded in time: :class:`StreamLimits`); once it is whole, one in the compute queue.
So a peer that sends a first part and stalls holds no compute slot, and only a capped share of stream slots,
for a few seconds. A request is counted at :func:`request_cost`, which includes attention's length term, and a
pass whose caller has gone (timed out, told busy, disconnected) is cancelled between blocks.
"""
from __future__ import annotations

import asyncio
import ctypes
import inspect
import logging
import threading
import time
import weakref
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Generator, Hashable, Optional, TypeVar

import torch

from swarm.adapters.block import BlockAdapter
from swarm.diffusion.prediction import HeadQuery, predict_states
from swarm.models.cost import attention_length_scale, request_cost
from swarm.models.kv_cache import SpanKV
from swarm.models.modules import BlockSpan, OutputHead, PassCancelled
from swarm.server.scheduler import FairScheduler, Job
from swarm.wire.messages import ErrorCode, RemoteError

if TYPE_CHECKING:
    from swarm.server.config import ServerConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")


class HeapTrimmer:
    """Gives the heap's free memory back to the system a moment after the last admission that computes
    has emptied (or one that holds finished outputs, such as pushes, empties while none computes).

    glibc keeps freed memory for reuse, and after the first large block is freed it stops mapping large
    blocks on their own, so a server that once held a large request or a flood of pushes would keep that
    memory for good (benchmarks/server_bounds.py, a push flood on a server of 300 MiB: 646 MiB stayed
    without trimming, 320-360 MiB with it). A trim costs about 30 ms after heavy work and nothing when there
    is little to give back; a fixed mapping threshold instead (``MALLOC_MMAP_THRESHOLD_``) made compute
    1.6x slower.
    """

    DELAY_S = 1.0

    def __init__(self) -> None:
        self.libc = _glibc()
        self.active: weakref.WeakSet[Admission] = weakref.WeakSet()  # the admissions holding something
        self.scheduled = False

    def busy(self, admission: "Admission") -> None:
        if admission.computes:
            self.active.add(admission)

    def idle(self, admission: "Admission") -> None:
        self.active.discard(admission)
        if self.libc is None or self.scheduled or self.active:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # released outside a loop (a test, a shutdown): nothing to schedule on
            return
        self.scheduled = True
        loop.call_later(self.DELAY_S, self._trim)

    def _trim(self) -> None:
        self.scheduled = False
        if not self.active:
            self.libc.malloc_trim(0)


def _glibc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc: its allocator has its own policy
        return None


TRIMMER = HeapTrimmer()


class Admission:
    """Counts what peers hold (a number of items and an amount: tokens or bytes), in total and per peer.

    Beyond ``max_count`` items or ``max_amount`` in total, or beyond ``peer_share`` of either for one peer,
    a request is refused as busy instead of waiting: a bound on what may wait is what keeps a server's
    memory and latency in check, and the per-peer share keeps one client from taking every slot. The
    first item of an empty queue (or of a peer holding nothing) is admitted whatever its amount, so a
    request that passed the size checks can always run on an idle server. ``computes``: what it admits
    allocates as it runs (the heap is trimmed only while no such admission holds anything).
    """

    def __init__(self, what: str, max_count: int, max_amount: Optional[int] = None, unit: str = "tokens",
                 peer_share: float = 1.0, computes: bool = True, reserve: float = 0.0):
        if not 0 < peer_share <= 1:
            raise ValueError(f"peer_share must be in (0, 1], got {peer_share}")
        if not 0 <= reserve < 1:
            raise ValueError(f"reserve must be in [0, 1), got {reserve}")
        self.what, self.unit, self.computes = what, unit, computes
        self.max_count, self.max_amount, self.peer_share = max_count, max_amount, peer_share
        # kept for known peers (see PeerRecords): ids are free, so a flood of new ones cannot take these
        self.reserved_count = min(max_count - 1, round(max_count * reserve))
        self.reserved_amount = int(max_amount * reserve) if max_amount is not None else 0
        self.count = self.amount = 0
        self.peer_counts: Counter[str] = Counter()
        self.peer_amounts: Counter[str] = Counter()
        self.refused = 0

    @property
    def peer_max_count(self) -> int:
        return max(1, int(self.max_count * self.peer_share))

    def acquire(self, peer: str, amount: int, known: bool = False) -> "Grant":
        """Hold ``amount`` for ``peer`` until the grant is released; :class:`RemoteError` (busy) if over a bound.
        Only a ``known`` peer may take the reserved places."""
        self.check(peer, amount, known)
        self.count += 1
        self.amount += amount
        self.peer_counts[peer] += 1
        self.peer_amounts[peer] += amount
        TRIMMER.busy(self)
        return Grant(self, peer, amount)

    def check(self, peer: str, amount: int, known: bool = False) -> None:
        """:class:`RemoteError` (busy) if ``acquire`` would refuse now: a request is refused before its rest is
        received when it could not be admitted anyway."""
        reason = self._over_bound(peer, amount, known)
        if reason is not None:
            self.refused += 1
            raise RemoteError(ErrorCode.BUSY, f"server busy: {reason}")

    def _over_bound(self, peer: str, amount: int, known: bool = False) -> Optional[str]:
        if self.count >= self.max_count:
            return f"{self.count} {self.what} in flight, the most it takes"
        if not known and self.count >= self.max_count - self.reserved_count:
            return (f"{self.count} {self.what} in flight; the other {self.reserved_count} are kept for peers that "
                    f"completed requests here")
        max_amount = self.max_amount if known or self.max_amount is None else self.max_amount - self.reserved_amount
        if max_amount is not None and self.count and self.amount + amount > max_amount:
            return f"{self.amount} {self.unit} of {self.what} queued, {amount} more would pass {max_amount}"
        held, held_amount = self.peer_counts[peer], self.peer_amounts[peer]
        if held >= self.peer_max_count:
            return f"this peer holds {held} {self.what}, its share of the {self.max_count} it takes"
        share = int(self.peer_share * self.max_amount) if self.max_amount is not None else None
        if share is not None and held and held_amount + amount > share:
            return (f"this peer holds {held_amount} {self.unit} of {self.what}, {amount} more would pass its share "
                    f"of {share}")
        return None

    def _release(self, peer: str, amount: int) -> None:
        self.count -= 1
        self.amount -= amount
        self.peer_counts[peer] -= 1
        self.peer_amounts[peer] -= amount
        if not self.peer_counts[peer]:
            del self.peer_counts[peer], self.peer_amounts[peer]  # a peer that left holds no memory here
        if not self.count:
            TRIMMER.idle(self)

    def info(self) -> dict:
        return {"in_flight": self.count, self.unit: self.amount, "peers": len(self.peer_counts),
                "refused": self.refused}


class Grant:
    """What one request holds in an :class:`Admission`; released once (later calls do nothing).

    As a context manager it is released on exit unless it was handed on to whatever outlives the block (the
    compute thread, a background push), which then releases it."""

    def __init__(self, admission: Admission, peer: str, amount: int):
        self.admission, self.peer, self.amount = admission, peer, amount
        self.released = self.handed_on = False
        self.seconds = 0.0  # how long its work held the compute thread (set when the work leaves it)
        self.proved = 0.0  # units of cost the request's work stamp proved (swarm.wire.work): its place in the order
        self.contended = False  # its work waited for another's: the thread was busy or others queued when it came

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission._release(self.peer, self.amount)

    def hand_on(self) -> "Grant":
        self.handed_on = True
        return self

    def __enter__(self) -> "Grant":
        return self

    def __exit__(self, *exc) -> None:
        if not self.handed_on:
            self.release()


class PeerRecords:
    """Peers that completed requests here, most recent last: they are admitted to the reserved places.

    A peer becomes known after ``known_after`` requests computed and answered, and loses its record when a
    stream of its own is dropped for missing its deadline. At most ``max_peers`` are remembered (the least
    recently seen forgotten first), so a flood of ids costs a bounded amount of memory."""

    def __init__(self, known_after: int = 2, max_peers: int = 4096):
        self.known_after, self.max_peers = known_after, max_peers
        self.completed: OrderedDict[str, int] = OrderedDict()

    def known(self, peer: str) -> bool:
        return self.completed.get(peer, 0) >= self.known_after

    def complete(self, peer: str) -> None:
        self.completed[peer] = self.completed.pop(peer, 0) + 1
        while len(self.completed) > self.max_peers:
            self.completed.popitem(last=False)

    def stalled(self, peer: str) -> None:
        self.completed.pop(peer, None)

    def info(self) -> dict:
        return {"known": sum(count >= self.known_after for count in self.completed.values())}


@dataclass(frozen=True)
class StreamLimits:
    """Bounds on requests whose stream has not delivered all its parts yet (``--max-unfinished-streams``...).

    Their count and cost are capped over all peers (ids are free), one peer holds at most its share, and each
    has a deadline proportional to its declared size (:meth:`deadline`), far shorter than the request timeout:
    a peer that sends a first part and stalls loses its place within seconds. ``known_reserve`` of these and
    of the compute queue's places are kept for peers with completed requests (:class:`PeerRecords`)."""

    max_unfinished: int = 16
    receive_timeout: float = 5.0  # seconds, plus the time the declared bytes take at receive_rate
    receive_rate: float = 2**20  # bytes per second a sender must at least keep up
    known_reserve: float = 0.0  # none unless configured: a queue whose handler keeps no records (experts) needs none

    @classmethod
    def of(cls, config: "ServerConfig") -> "StreamLimits":
        return cls(config.max_unfinished_streams, config.receive_timeout, config.receive_rate_mb * 2**20,
                   config.known_peer_reserve)

    def deadline(self, max_bytes: int, request_timeout: float) -> float:
        """Seconds a stream declaring at most ``max_bytes`` has to deliver them, never over ``request_timeout``."""
        return min(request_timeout, self.receive_timeout + max_bytes / self.receive_rate)


class ComputeQueue:
    """One compute thread behind an :class:`Admission` of requests and tokens, and an admission of unfinished
    streams in front of it (:class:`StreamLimits`).

    Whole requests wait in a :class:`~swarm.server.scheduler.FairScheduler`, which picks the next one whenever the
    thread is free: never idle while one waits, fair by caller (where callers prove work) when several do (torch uses
    its own threads inside each pass). Requests run with a ``key`` may be computed together: when the thread frees,
    the next request is joined by the others already waiting with the same key (in fair order, up to ``batch_size``
    positions), and ``merge`` computes them as one pass. Nothing waits for a batch to fill: a request is batched only
    with those that queued while the thread was busy anyway.

    A request keeps its place until its work has left the thread, even when its caller stopped waiting (a timeout):
    the thread's backlog is what the bounds are about. A request whose caller stopped waiting before it started is
    never run; a pass run with a ``cancel`` event is told to stop when its caller stops waiting, so it leaves the
    thread within about one block's time.

    The queue never preempts a piece of work, so a long pass may be given in pieces: a ``fn`` (or ``merge``) that
    returns a generator runs up to its first ``yield`` and goes back to the scheduler (:meth:`FairScheduler.resume`),
    and whoever has had less than its caller goes first; its callers are answered with the generator's return value
    after its last piece. A small call then waits at most for the piece under way, not for the whole long pass.
    """

    def __init__(self, max_concurrent: int, max_queued_tokens: Optional[int] = None, name: str = "compute",
                 peer_share: float = 1.0, streams: StreamLimits = StreamLimits(),
                 scheduler: Optional[FairScheduler] = None):
        self.streams = streams

        def admission(what: str, max_count: int, computes: bool) -> Admission:
            """Both admissions count tokens, with the same per-peer share and reserve for known peers."""
            return Admission(what, max_count, max_queued_tokens, "tokens", peer_share, computes=computes,
                             reserve=streams.known_reserve)

        self.admission = admission("requests", max_concurrent, computes=True)
        self.unfinished = admission("unfinished streams", streams.max_unfinished, computes=False)
        self.records = PeerRecords()
        self.scheduler = scheduler if scheduler is not None else FairScheduler()
        self.merge: Optional[Callable[[list[tuple]], list]] = None  # computes several keyed requests as one pass
        self.batch_size = 0  # most positions (batch x length) merged into one pass; 0 merges nothing
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.running = False  # a pass (or a merged batch) is on the thread
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.abandoned = 0  # passes whose caller stopped waiting (timeout, busy answer, disconnect)
        self.cancelled = 0  # ... of which were stopped between blocks (the others had not started or had ended)
        self.dropped_streams = 0  # unfinished streams dropped at their deadline
        self.batches = self.batched = 0  # merged passes, and the requests they computed
        self.pieces = 0  # pieces of passes run in pieces, but their last: the times a long pass let others go first

    @property
    def in_flight(self) -> int:
        return self.admission.count

    @property
    def queued_tokens(self) -> int:
        return self.admission.amount

    def admit(self, peer: str, tokens: int, proved: float = 0.0) -> Grant:
        """Take a place in the compute queue (see :class:`Admission`); known peers may take the reserved ones.
        ``proved``: units of cost the request's work stamp proved (its place in the fair order, never admission)."""
        grant = self.admission.acquire(peer, tokens, self.records.known(peer))
        grant.proved = proved
        return grant

    def check(self, peer: str, tokens: int) -> None:
        """Busy now if :meth:`admit` would refuse: checked on a stream's first part, before the rest comes."""
        self.admission.check(peer, tokens, self.records.known(peer))

    def receive_place(self, peer: str, tokens: int) -> Grant:
        """A place among the unfinished streams while the request's parts arrive."""
        return self.unfinished.acquire(peer, tokens, self.records.known(peer))

    def check_receive(self, peer: str) -> None:
        """Busy now if ``peer`` could get no place among the unfinished streams: checked before a stream's first
        part is even read."""
        self.unfinished.check(peer, 0, self.records.known(peer))

    def stream_dropped(self, peer: str) -> None:
        """``peer``'s stream missed its deadline: counted, and the peer loses its record."""
        self.dropped_streams += 1
        self.records.stalled(peer)

    async def run(self, tokens: int, fn: Callable[..., T], *args, peer: str = "", grant: Optional[Grant] = None,
                  cancel: Optional[threading.Event] = None, key: Optional[Hashable] = None, size: int = 0,
                  proved: float = 0.0) -> T:
        """Run ``fn(*args)`` on the compute thread under ``grant`` (taken here for ``peer``, with ``proved`` work, when
        None), when the scheduler says so; ``cancel`` (an event ``fn`` checks as it goes) is set when the caller stops
        waiting.
        ``key``: requests with equal keys may be computed together by ``merge`` (``size``: their positions)."""
        with grant if grant is not None else self.admit(peer, tokens, proved) as held:
            self.loop = asyncio.get_running_loop()
            work: Future = Future()
            job = Job(held.peer, tokens, _Work(held, work, fn, args), key if self.merge else None, work.cancelled,
                      size, proved=held.proved)
            # Released when the work has left the thread (done, failed, or cancelled before it started).
            work.add_done_callback(lambda done: _call_soon(self.loop, lambda: self._left(done, held)))
            held.hand_on()
            held.contended = self.running or len(self.scheduler) > 0
            self.scheduler.push(job, time.time())
            self._dispatch()
        try:
            return await asyncio.wrap_future(work)
        except asyncio.CancelledError:  # a timeout, a busy answer or a caller that left: nobody reads the answer
            self.abandoned += 1
            work.cancel()  # never run if it has not started
            if cancel is not None:
                cancel.set()
            raise

    def _dispatch(self) -> None:
        """On the event loop: give the free thread the next pass (and the waiting passes it can be merged with), or
        the next piece of a pass under way (with the mates it started with)."""
        while not self.running:
            first = self.scheduler.pop()
            if first is None:
                return
            if first.resumed:
                jobs = first.payload.group
            else:
                jobs = [job for job in [first] + self._mates(first) if job.payload.work.set_running_or_notify_cancel()]
            if not jobs:
                continue
            self.running = True
            self.executor.submit(self._compute, jobs).add_done_callback(
                lambda done, jobs=jobs: _call_soon(self.loop, lambda: self._thread_free(done, jobs)))

    def _mates(self, first: Job) -> list[Job]:
        """Waiting passes to merge with ``first``: its key, no larger than it, not under way, up to the batch size."""
        mates, room = [], self.batch_size - first.size
        while first.key is not None and room > 0:
            more = self.scheduler.pop(lambda job: job.key == first.key and not job.resumed
                                      and job.size <= min(room, first.size))
            if more is None:
                break
            mates.append(more)
            room -= more.size
        return mates

    def _thread_free(self, done: Future, jobs: list[Job]) -> None:
        """The piece or pass has left the thread; a pass with pieces left goes back to the scheduler. The next one is
        chosen one loop turn later, after the callers woken by this pass's answers have run: one that sends its next
        request at once joins the next pass instead of taking the thread alone (a wait of one turn of the event loop,
        never of the clock)."""
        if not done.cancelled() and done.exception() is None and done.result():
            self.scheduler.resume(jobs[0])
        self.loop.call_soon(self._hand_on)

    def _hand_on(self) -> None:
        self.running = False
        self._dispatch()

    def _compute(self, jobs: list[Job]) -> bool:
        """On the compute thread: one pass, or several merged, or their next piece; each caller charged its part of
        the time. True when the pass has pieces left (its callers are answered after its last)."""
        began, head = time.perf_counter(), jobs[0].payload
        more = False
        try:
            if head.pieces is None:
                outcome = head.fn(*head.args) if len(jobs) == 1 else self.merge([job.payload.args for job in jobs])
                if len(jobs) > 1:
                    self.batches += 1
                    self.batched += len(jobs)
                if inspect.isgenerator(outcome):
                    head.pieces, head.group = outcome, jobs
            if head.pieces is not None:
                try:
                    next(head.pieces)
                    more = True
                except StopIteration as finished:
                    outcome, head.pieces = finished.value, None
                else:
                    self.pieces += 1
        except BaseException as error:  # every caller of the pass gets its failure
            head.pieces = None
            for job in jobs:
                job.payload.work.set_exception(error)
        else:
            if not more:
                for job, result in zip(jobs, [outcome] if len(jobs) == 1 else outcome):
                    job.payload.work.set_result(result)
        finally:
            seconds, total = time.perf_counter() - began, sum(job.cost for job in jobs) or 1
            for job in jobs:
                job.payload.grant.seconds += seconds * (job.cost / total if len(jobs) > 1 else 1)
        return more

    def _left(self, work: Future, grant: Grant) -> None:
        """The work has left the thread: its place is free again."""
        if not work.cancelled() and isinstance(work.exception(), PassCancelled):
            self.cancelled += 1
        grant.release()

    def info(self) -> dict:
        return {**self.admission.info(), "abandoned": self.abandoned, "cancelled": self.cancelled,
                "unfinished": {**self.unfinished.info(), "dropped": self.dropped_streams},
                "scheduler": {**self.scheduler.info(), "batches": self.batches, "batched_requests": self.batched,
                               "pieces": self.pieces},
                **self.records.info()}

    def shutdown(self) -> None:
        """Requests still waiting are cancelled (their places released), the running pass finishes."""
        while (job := self.scheduler.pop()) is not None:
            if job.resumed:  # under way: its callers are told, its rest is never computed
                job.payload.pieces.close()
                for mate in job.payload.group:
                    mate.payload.work.set_exception(PassCancelled("the server is shutting down"))
            else:
                job.payload.work.cancel()
        self.executor.shutdown(wait=True, cancel_futures=True)


@dataclass
class _Work:
    """What a queued :class:`Job` runs, and where its answer goes."""

    grant: Grant
    work: Future
    fn: Callable
    args: tuple
    pieces: Optional[Generator] = None  # a pass under way in pieces (``fn`` returned a generator): the rest of it
    group: list[Job] = field(default_factory=list)  # ... and the jobs it answers (its mates when merged)


def _call_soon(loop: Optional[asyncio.AbstractEventLoop], callback: Callable[[], None]) -> None:
    """Run ``callback`` on ``loop`` from any thread; nothing when the loop has closed (the server is gone)."""
    try:
        loop.call_soon_threadsafe(callback)
    except (RuntimeError, AttributeError):
        pass


@dataclass(frozen=True)
class SpanCall:
    """One pass a backend computes: hidden states through blocks ``start:end``, filling or reusing ``kv`` (a reuse
    computes ``rows`` only), with a per-block ``adapter``, answering ``head``'s predictions when given."""

    hidden: torch.Tensor
    start: int
    end: int
    kv: Optional[SpanKV] = None
    rows: Optional[tuple[int, int]] = None
    head: Optional[HeadQuery] = None
    adapter: Optional[BlockAdapter] = None


def batch_key(call: SpanCall) -> Optional[tuple]:
    """What a forward pass may be merged with others on: a stateless pass (no cache, no adapter) is, with those of the
    same blocks and length (rows of one length concatenated along the batch, the layout the model's passes are
    invariant to); any other runs alone (None)."""
    if call.kv is not None or call.rows is not None or call.adapter is not None or call.hidden.dim() != 3:
        return None
    return ("forward", call.start, call.end, call.hidden.shape[1])


class _AllSet:
    """The cancel event of a merged pass: set once every caller's own event is."""

    def __init__(self, events: list[threading.Event]):
        self.events = events

    def is_set(self) -> bool:
        return all(event.is_set() for event in self.events)


MAX_PIECE_TOKENS = 16384  # positions x blocks a forward pass computes before letting a waiting pass go first


def piece_bounds(start: int, end: int, positions: int, max_piece_tokens: int) -> list[tuple[int, int]]:
    """Blocks ``start:end`` cut into pieces of at most ``max_piece_tokens`` positions x blocks (one block at least):
    a pass of ``positions`` rows is computed piece by piece, the same blocks in the same order on the same tensor, so
    its numbers are those of one pass; a waiting call goes between two pieces."""
    step = max(1, max_piece_tokens // max(1, positions))
    return [(first, min(first + step, end)) for first in range(start, end, step)]


class SpanBackend:
    """Runs forward passes of one span; refuses work beyond its bounds instead of queueing forever.

    A forward pass of more than ``max_piece_tokens`` positions x blocks runs in pieces between blocks
    (:func:`piece_bounds`), each going back to the fair order, so a small call waits for one piece at most.

    With ``head`` (the final norm and output head, for a span ending at the last block) a pass can end with the
    sampler's predictions instead of hidden states (:func:`swarm.diffusion.prediction.predict_states`)."""

    def __init__(self, span: BlockSpan, max_concurrent: int, device: str = "cpu",
                 max_queued_tokens: Optional[int] = None, peer_share: float = 1.0,
                 head: Optional[OutputHead] = None, streams: StreamLimits = StreamLimits(),
                 scheduler: Optional[FairScheduler] = None, batching: bool = False, max_batch_tokens: int = 16384,
                 max_piece_tokens: int = MAX_PIECE_TOKENS):
        if max_piece_tokens < 1:
            raise ValueError(f"max_piece_tokens must be at least 1, got {max_piece_tokens}")
        self.span = span.requires_grad_(False)  # frozen: a backward call computes the inputs' gradient only
        self.head = head.requires_grad_(False) if head is not None else None
        self.device = torch.device(device)
        self.dtype = next(span.parameters()).dtype
        self.queue = ComputeQueue(max_concurrent, max_queued_tokens, "span-compute", peer_share, streams, scheduler)
        if batching:  # stateless forward passes of equal blocks and length are computed together
            self.queue.merge, self.queue.batch_size = self._merge, max_batch_tokens
        self.max_piece_tokens = max_piece_tokens
        self.max_positions = span.config.max_position_embeddings
        self.length_scale = attention_length_scale(span.config)

    def cost(self, batch: int, length: int) -> int:
        """What a pass of ``batch`` x ``length`` positions is admitted at (:func:`request_cost`)."""
        return request_cost(batch, length, self.length_scale)

    @property
    def in_flight(self) -> int:
        return self.queue.in_flight

    @property
    def queued_tokens(self) -> int:
        return self.queue.queued_tokens

    @property
    def start(self) -> int:
        return self.span.start

    @property
    def end(self) -> int:
        return self.span.end

    @torch.inference_mode()
    def forward_sync(self, call: SpanCall, cancel: Optional[threading.Event] = None) -> torch.Tensor:
        """Run ``call``'s blocks (a sub-span of the held one), filling or reusing its cache (see BlockSpan), applying
        its per-block adapter before each block; with a head query, answer its predictions (float64) instead of
        the hidden states. Stopped between blocks once ``cancel`` is set."""
        adapter = call.adapter.to(self.device) if call.adapter is not None else None
        x = self.span(call.hidden.to(self.device, self.dtype), blocks=(call.start, call.end), kv=call.kv,
                      rows=call.rows, adapter=adapter, cancel=cancel)
        return self._answer(x, call)

    def _answer(self, x: torch.Tensor, call: SpanCall) -> torch.Tensor:
        """``call``'s answer from the span's output ``x``: the hidden states, or its head query's predictions."""
        x = x.to(self.dtype)  # the compute dtype: the wire carries it as is by default (lossless)
        if call.head is None:
            return x.cpu()
        logits = self.head.scored_logits(x, call.rows[0] if call.rows is not None else 0, call.head.scored)
        return predict_states(logits.cpu(), call.head)

    def forward_pieces(self, call: SpanCall, cancel: Optional[threading.Event] = None
                       ) -> Generator[None, None, torch.Tensor]:
        """:meth:`forward_sync` in pieces (:func:`piece_bounds`), yielding between them; returns its answer."""
        return self._pieces([call], cancel, lambda x: self._answer(x, call))

    def _merge(self, items: list[tuple[SpanCall, threading.Event]]
               ) -> list[torch.Tensor] | Generator[None, None, list[torch.Tensor]]:
        """The queue's merge: :meth:`forward_batch_sync` for a merged pass of one piece, else
        :meth:`forward_batch_pieces`."""
        calls = [call for call, _ in items]
        positions = sum(call.hidden.shape[0] for call in calls) * calls[0].hidden.shape[1]
        if len(piece_bounds(calls[0].start, calls[0].end, positions, self.max_piece_tokens)) == 1:
            return self.forward_batch_sync(items)
        return self.forward_batch_pieces(items)

    def forward_batch_sync(self, items: list[tuple[SpanCall, threading.Event]]) -> list[torch.Tensor]:
        """:meth:`forward_batch_pieces` run to its end: the merged pass in one go."""
        pieces = self.forward_batch_pieces(items)
        while True:
            try:
                next(pieces)
            except StopIteration as finished:
                return finished.value

    def forward_batch_pieces(self, items: list[tuple[SpanCall, threading.Event]]
                             ) -> Generator[None, None, list[torch.Tensor]]:
        """Several callers' stateless passes (same blocks, same length: :func:`batch_key`) as one: their rows
        concatenated along the batch, run once (in pieces, yielding between them), and split again, each answered as
        :meth:`forward_sync` would. A row's result does not depend on its batch-mates only where the model's passes
        are batch-invariant (not yet guaranteed: docs/ARCHITECTURE.md, "Server"). Stopped between blocks only once
        every caller has stopped waiting."""
        calls = [call for call, _ in items]

        def answers(x: torch.Tensor) -> list[torch.Tensor]:
            out, row = [], 0
            for call in calls:
                rows = call.hidden.shape[0]
                out.append(self._answer(x[row:row + rows].clone(), call))
                row += rows
            return out

        return self._pieces(calls, _AllSet([event for _, event in items]), answers)

    def _pieces(self, calls: list[SpanCall], cancel, answer: Callable[[torch.Tensor], T]) -> Generator[None, None, T]:
        """The blocks of ``calls`` (one call, or mates of one shape whose rows are concatenated), piece by piece; the
        inference mode is entered per piece, never held across a ``yield`` (the thread runs other passes between)."""
        first = calls[0]
        with torch.inference_mode():
            x = torch.cat([call.hidden.to(self.device, self.dtype) for call in calls]) if len(calls) > 1 else \
                first.hidden.to(self.device, self.dtype)
            adapter = first.adapter.to(self.device) if first.adapter is not None else None
        bounds = piece_bounds(first.start, first.end, x.shape[0] * x.shape[1], self.max_piece_tokens)
        for index, (start, end) in enumerate(bounds):
            if index:
                yield
            with torch.inference_mode():
                part = adapter.slice(start - first.start, end - first.start) if adapter is not None else None
                x = self.span(x, blocks=(start, end), kv=first.kv, rows=first.rows, adapter=part, cancel=cancel)
        with torch.inference_mode():
            return answer(x)

    def pieces_of(self, call: SpanCall) -> int:
        """How many pieces ``call``'s forward pass runs in."""
        return len(piece_bounds(call.start, call.end, call.hidden.shape[0] * call.hidden.shape[1],
                                self.max_piece_tokens))

    async def forward(self, call: SpanCall, *, peer: str = "", grant: Optional[Grant] = None,
                      proved: float = 0.0) -> torch.Tensor:
        """The span's output; ``grant`` is the place :meth:`ComputeQueue.admit` gave the request (taken here
        for ``peer``, with ``proved`` work, when None). A pass of one piece runs :meth:`forward_sync`, a longer one
        :meth:`forward_pieces`."""
        cost, cancel = self.cost(*call.hidden.shape[:2]), threading.Event()
        fn = self.forward_sync if self.pieces_of(call) == 1 else self.forward_pieces
        return await self.queue.run(cost, fn, call, cancel, peer=peer, grant=grant, cancel=cancel,
                                    key=batch_key(call), size=call.hidden.shape[0] * call.hidden.shape[1],
                                    proved=proved)

    def backward_sync(self, call: SpanCall, grad_outputs: torch.Tensor, cancel: Optional[threading.Event] = None
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The gradient of the input of ``call``'s blocks (float32, ``call.hidden`` being that input), recomputing
        their forward with autograd, and of its per-block adapter's weights when it has one (float32, else None).

        The weights take no gradient (they are frozen), so autograd keeps only the activations of this one pass,
        freed when it returns."""
        adapter = call.adapter
        with torch.inference_mode(False), torch.enable_grad():
            x = call.hidden.to(self.device, self.dtype).requires_grad_(True)
            if adapter is not None:  # a leaf of its own: the weights may be the store's, shared with other requests
                adapter = adapter.to(self.device).detach()
                adapter.weights.requires_grad_(True)
            leaves = (x,) if adapter is None else (x, adapter.weights)
            y = self.span(x, blocks=(call.start, call.end), adapter=adapter, cancel=cancel)
            grads = torch.autograd.grad(y, leaves, grad_outputs.to(self.device, y.dtype))
        return grads[0].float().cpu(), grads[1].float().cpu() if adapter is not None else None

    async def backward(self, call: SpanCall, grad_outputs: torch.Tensor, *, peer: str = "",
                       grant: Optional[Grant] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """:meth:`backward_sync` on the compute thread, under the same queue and bounds as forward passes."""
        cost, cancel = self.cost(2 * call.hidden.shape[0], call.hidden.shape[1]), threading.Event()
        return await self.queue.run(cost, self.backward_sync, call, grad_outputs, cancel, peer=peer, grant=grant,
                                    cancel=cancel)

    def shutdown(self) -> None:
        self.queue.shutdown()
