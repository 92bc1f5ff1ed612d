"""Clients' evidence handed to an auditor over libp2p (issue 55): taken within bounds, queued fairly per caller.

An auditor serves :class:`~swarm.wire.services.EvidenceService` on its own peer (``python -m swarm.audit`` logs the
peer id; clients name it with ``ClientConfig.evidence_auditors`` / ``--evidence-to``). Each call hands one piece of
evidence (:mod:`swarm.wire.handoff`); :class:`EvidenceInbox` treats it as hostile input:

* the header is read first (one stream message, at most 2 MiB) and refused on its own: a size over
  :data:`~swarm.wire.evidence.MAX_EVIDENCE_BYTES`, or, from a peer the auditor does not trust
  (``--evidence-from``), no fresh work stamp of :data:`~swarm.wire.handoff.HANDOFF_BITS` bits for this auditor
  (checked and spent as a server's are, :class:`~swarm.server.work_check.StampCheck`), or a caller whose share of
  the queue is full: nothing more is read;
* the body is read within a deadline, never past the size the header declared, the bytes of all hand-offs being read
  together within :data:`MAX_READING_BYTES` (counted as they arrive, so a slow sender holds only what it sent), then
  parsed by :meth:`CallEvidence.from_bytes` (every field typed and bounded);
* :class:`EvidenceQueue` holds at most :data:`MAX_QUEUED` pieces and :data:`MAX_QUEUED_BYTES`, at most
  :data:`MAX_PER_CALLER` per caller; a full queue makes room by dropping the newest piece of the stranger holding
  the most, only if it holds more than the newcomer would (a trusted client's piece displaces any stranger's, and is
  never displaced by one), and the auditor takes them round robin by caller (:data:`~swarm.audit.inbox
  .MAX_FILES_PER_ROUND` a round): free identities buy nothing, paying ones a fair share of what trusted clients leave.

Each round recomputes what it takes exactly as it does evidence files (:meth:`swarm.audit.auditor.Auditor
.take_evidence`): only a server whose own signature binds it to a wrong answer is failed.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from typing import AsyncIterator, Iterable, Optional

from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from swarm.server.work_check import StampCheck
from swarm.wire.encoding import error_response
from swarm.wire.evidence import MAX_EVIDENCE_BYTES, CallEvidence
from swarm.wire.handoff import HANDOFF_BITS, MAX_PER_HANDOFF, Header, read_body
from swarm.wire.messages import ErrorCode, RemoteError
from swarm.wire.services import EvidenceService

logger = logging.getLogger(__name__)

MAX_QUEUED = 64  # pieces waiting for a round, all callers together: each costs a pass of its call's blocks
MAX_QUEUED_BYTES = 256 * 2**20
MAX_PER_CALLER = MAX_PER_HANDOFF  # what one client hands at a time
MAX_READING_BYTES = 256 * 2**20  # bytes of hand-offs read and not yet queued, all callers together
READ_TIMEOUT_S = 120.0  # a hand-off's body arrives within this, or it is refused
PARSE_OFF_LOOP_BYTES = 2**20  # larger evidence is parsed on a thread


class EvidenceQueue:
    """Pieces of evidence waiting for the auditor's next round, by caller (see the module doc)."""

    def __init__(self, max_items: int = MAX_QUEUED, max_bytes: int = MAX_QUEUED_BYTES,
                 per_caller: int = MAX_PER_CALLER, trusted: Iterable[str] = ()):
        self.max_items, self.max_bytes, self.per_caller = max_items, max_bytes, per_caller
        self.trusted = frozenset(trusted)  # callers whose pieces strangers' never displace, and who displace theirs
        self.waiting: dict[str, deque[tuple[CallEvidence, int]]] = {}
        self.items = self.bytes = 0
        self.dropped = 0  # pieces dropped to make room for a caller holding fewer

    def room(self, caller: str, size: int) -> list[str]:
        """The callers whose newest pieces would make room for a piece of ``size`` bytes from ``caller``
        (:meth:`_victims`); :class:`RemoteError` (busy, too large) for one that could not be queued."""
        if size > self.max_bytes:
            raise RemoteError(ErrorCode.TOO_LARGE, f"evidence of {size} bytes is over this auditor's queue of "
                              f"{self.max_bytes}")
        if len(self.waiting.get(caller, ())) >= self.per_caller:
            raise RemoteError(ErrorCode.BUSY, f"{self.per_caller} pieces of yours already wait for a round",
                              retry_after=60.0)
        return self._victims(caller, size)

    def put(self, caller: str, evidence: CallEvidence, size: int) -> None:
        """Queue ``evidence`` (``size`` bytes) from ``caller``, dropping what fairness allows to make room;
        :class:`RemoteError` (busy) when it cannot be queued."""
        for victim in self.room(caller, size):
            held = self.waiting[victim]
            self.items, self.bytes = self.items - 1, self.bytes - held.pop()[1]
            self.dropped += 1
            if not held:
                del self.waiting[victim]
        self.waiting.setdefault(caller, deque()).append((evidence, size))
        self.items, self.bytes = self.items + 1, self.bytes + size

    def _victims(self, caller: str, size: int) -> list[str]:
        """The callers whose newest pieces make room for this one, in order: always the stranger holding the most,
        and only while it holds more than ``caller`` would (a trusted caller: while it holds any), else busy. At most
        :data:`MAX_QUEUED` callers are looked at per piece dropped."""
        counts = {peer: len(held) for peer, held in self.waiting.items() if peer not in self.trusted}
        sizes = {peer: [size for _, size in held] for peer, held in self.waiting.items()}
        items, total, victims = self.items + 1, self.bytes + size, []
        mine = 0 if caller in self.trusted else counts.get(caller, 0) + 1
        while items > self.max_items or total > self.max_bytes:
            victim = max((peer for peer in counts if counts[peer]), key=lambda peer: (counts[peer], sum(sizes[peer])),
                         default=None)
            if victim is None or victim == caller or counts[victim] <= mine:
                raise RemoteError(ErrorCode.BUSY, "this auditor's evidence queue is full", retry_after=60.0)
            counts[victim] -= 1
            items, total = items - 1, total - sizes[victim].pop()
            victims.append(victim)
        return victims

    def take(self, limit: int) -> list[tuple[str, CallEvidence]]:
        """Up to ``limit`` pieces, round robin by caller (oldest first within each), removed from the queue."""
        taken: list[tuple[str, CallEvidence]] = []
        while self.waiting and len(taken) < limit:
            for caller in list(self.waiting)[:limit - len(taken)]:
                held = self.waiting[caller]
                evidence, size = held.popleft()
                self.items, self.bytes = self.items - 1, self.bytes - size
                if not held:
                    del self.waiting[caller]
                taken.append((caller, evidence))
        return taken


class EvidenceInbox(EvidenceService):
    """The auditor's end of evidence hand-offs: ``trusted`` peers hand evidence without work; others only when
    ``open_to_all``, with a stamp per piece (see the module doc)."""

    def __init__(self, trusted: Iterable[str] = (), open_to_all: bool = True, queue: Optional[EvidenceQueue] = None,
                 stamps: Optional[StampCheck] = None, read_timeout: float = READ_TIMEOUT_S, bits: int = HANDOFF_BITS):
        self.trusted, self.open_to_all, self.bits = frozenset(trusted), open_to_all, bits
        self.queue = queue if queue is not None else EvidenceQueue(trusted=self.trusted)
        self.stamps = stamps if stamps is not None else StampCheck()
        self.read_timeout = read_timeout
        self.reading = 0  # bytes of bodies read and not yet queued or refused
        self.queued = 0
        self.refused: Counter[str] = Counter()  # hand-offs refused, by error code

    async def register(self, p2p: P2P) -> None:
        await self.add_p2p_handlers(p2p)

    async def unregister(self, p2p: P2P) -> None:
        await p2p.remove_binary_stream_handler(self._get_handle_name(None, "rpc_hand_evidence"))

    async def rpc_hand_evidence(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                                ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        caller = str(context.remote_id)
        try:
            await self.receive(requests, caller, str(context.local_id), time.time())
        except RemoteError as error:
            self.refused[error.code.value] += 1
            logger.info("refused evidence from %s: %s", caller, error.message[:200])
            yield error_response(error)
            return
        self.queued += 1
        yield runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"queued": True}))

    async def receive(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], caller: str, local: str,
                      now: float) -> None:
        """Read one hand-off from ``caller`` to this auditor's peer ``local`` and queue its evidence;
        :class:`RemoteError` for anything refused (nothing past the refusal is read)."""
        messages = aiter(requests)
        first = await anext(messages, None)
        if first is None:
            raise RemoteError(ErrorCode.BAD_REQUEST, "an empty hand-off")
        header = Header.parse(first, MAX_EVIDENCE_BYTES)
        self._admit(header, caller, local, now)
        self.queue.room(caller, header.size)
        held = [0]

        def hold(count: int) -> None:
            if self.reading + count > MAX_READING_BYTES:
                raise RemoteError(ErrorCode.BUSY, "this auditor is reading as much evidence as it takes at once",
                                  retry_after=10.0)
            self.reading += count
            held[0] += count

        try:
            data = await asyncio.wait_for(read_body(messages, header.size, hold), self.read_timeout)
        except asyncio.TimeoutError:
            raise RemoteError(ErrorCode.TIMEOUT, f"the evidence did not arrive within {self.read_timeout:g} s"
                              ) from None
        finally:
            self.reading -= held[0]
        try:
            evidence = await asyncio.to_thread(CallEvidence.from_bytes, data) if len(data) > PARSE_OFF_LOOP_BYTES \
                else CallEvidence.from_bytes(data)
        except ValueError as error:
            raise RemoteError(ErrorCode.BAD_REQUEST, f"not evidence: {str(error)[:200]}") from None
        self.queue.put(caller, evidence, header.size)

    def _admit(self, header: Header, caller: str, local: str, now: float) -> None:
        """A trusted caller's hand-off, or a stranger's with a fresh stamp of ``bits`` (:data:`HANDOFF_BITS`) for
        this peer."""
        if caller in self.trusted:
            return
        if not self.open_to_all:
            raise RemoteError(ErrorCode.BAD_REQUEST, "this auditor takes evidence only from the clients it trusts "
                              "(its --evidence-from)")
        if self.stamps.credit(header.work, local, caller, now) < 2.0**self.bits / self.stamps.price:
            raise RemoteError(ErrorCode.BAD_REQUEST, f"evidence from a peer this auditor does not trust needs a "
                              f"fresh work stamp of {self.bits} bits for this auditor's peer id, each used once")

    def info(self) -> dict:
        return {"queued": self.queued, "waiting": self.queue.items, "dropped": self.queue.dropped,
                "refused": dict(self.refused)}
