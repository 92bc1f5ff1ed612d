"""The receipts of a client's real calls, and the sample of them it can hand to auditors (issue 55).

Every answer a server gives carries a receipt (:mod:`swarm.wire.receipts`), checked by
:class:`~swarm.wire.remote.RemoteCaller` as it arrives. :class:`ReceiptBook` keeps them, cheaply: every receipt's
digests (bounded), the fills (a reuse's receipt must name the fill this client sent, or the call is the server's
failure: a server cannot make its reuses unprovable by naming a fill nobody has), and a random share
(``ClientConfig.audit_share``, drawn from ``os.urandom`` per call) of calls with their tensors, as
:class:`~swarm.wire.evidence.CallEvidence` for whoever recomputes them. Calls made inside :meth:`private` are never
kept with their tensors: a sample shows the call's hidden states (hence its prompt) to whoever recomputes it.

Because the sampled calls are the client's own (its long-lived identity, its sessions, its passes merged with other
clients' on a batching server), a server cannot answer them differently from real use: they are real use.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import random
import threading
from pathlib import Path
from typing import Iterator, Optional

from hivemind.proto import runtime_pb2

from swarm.wire.evidence import CallEvidence
from swarm.wire.messages import ErrorCode, ForwardRequest, RemoteError
from swarm.wire.receipts import Receipt, short
from swarm.wire.remote import SignedCall

logger = logging.getLogger(__name__)

MAX_RECEIPTS = 4096  # digests only: about 800 bytes each
MAX_FILLS = 16  # fills remembered to check and prove reuses (their answers dropped: a proof does not need them)
MAX_RECENT = 8  # the latest calls, so a spot check that finds a lie can turn the call into a proof
MAX_KEPT = 64  # sampled calls kept with their tensors
MAX_KEPT_BYTES = 32 * 2**20  # at 8B widths a client stays within 0.5 GB (tests/test_client_memory.py)
SUFFIX = ".evidence"  # one saved call's evidence (save_sample; an auditor's --evidence-dir reads them)

NO_ANSWER = runtime_pb2.Tensor()  # what a remembered fill keeps of its answer
FillKey = tuple[str, str, int, int, int]  # (peer, session, start, end, version)


class ReceiptBook:
    """Receipts and a sample of calls (see the module doc)."""

    def __init__(self, share: float, rng: Optional[random.Random] = None):
        self.share = share
        self.rng = rng or random.SystemRandom()
        self.receipts: collections.deque[Receipt] = collections.deque(maxlen=MAX_RECEIPTS)
        self.unsigned = 0  # answers that came without a receipt (older servers)
        self._fills: collections.OrderedDict[FillKey, SignedCall] = collections.OrderedDict()
        self._recent: collections.OrderedDict[int, SignedCall] = collections.OrderedDict()
        self._kept: collections.deque[SignedCall] = collections.deque()
        self._kept_bytes = 0
        self._private = 0
        self._lock = threading.Lock()  # calls in flight (stale pipelining) record at once

    @contextlib.contextmanager
    def private(self) -> Iterator[None]:
        """Calls made inside are receipted but never kept with their tensors (nothing of them can be shared)."""
        with self._lock:
            self._private += 1
        try:
            yield
        finally:
            with self._lock:
                self._private -= 1

    def record(self, call: SignedCall) -> None:
        """Keep ``call``'s receipt; raise :class:`RemoteError` when a reuse's receipt names a fill this client did
        not send to that server (the server's failure)."""
        receipt, request = call.receipt, call.request
        if receipt is None:
            self.unsigned += 1
            return
        with self._lock:
            self._check_fill(call)
            self.receipts.append(receipt)
            self._recent[id(request)] = call
            while len(self._recent) > MAX_RECENT:
                self._recent.popitem(last=False)
            if request.cache is not None and request.cache.fill:
                self._fills[fill_key(call.peer_id, request)] = dataclasses.replace(call, answer=NO_ANSWER)
                while len(self._fills) > MAX_FILLS:
                    self._fills.popitem(last=False)
            if not self._private and self.share > 0 and self.rng.random() < self.share:
                self._keep(call)

    def _check_fill(self, call: SignedCall) -> None:
        request = call.request
        if request.cache is None or request.cache.fill:
            return
        fill = self._fills.get(fill_key(call.peer_id, request))
        if fill is not None and fill.receipt.request != call.receipt.fill:
            raise RemoteError(ErrorCode.INTERNAL, f"the receipt of a reuse names fill {short(call.receipt.fill)}, "
                              f"not {short(fill.receipt.request)} that this client sent", call.peer_id)

    def _keep(self, call: SignedCall) -> None:
        size = len(call.hidden.buffer) + len(call.answer.buffer)
        self._kept.append(call)
        self._kept_bytes += size
        while len(self._kept) > MAX_KEPT or self._kept_bytes > MAX_KEPT_BYTES:
            old = self._kept.popleft()
            self._kept_bytes -= len(old.hidden.buffer) + len(old.answer.buffer)

    def for_request(self, request: ForwardRequest) -> Optional[SignedCall]:
        """The recent call that sent ``request`` (None when it came without a receipt or is no longer recent)."""
        with self._lock:
            call = self._recent.get(id(request))
        return call if call is not None and call.request is request else None

    def evidence(self, call: SignedCall) -> Optional[CallEvidence]:
        """``call`` as evidence, with its fill when it reuses one (None when the fill is no longer known)."""
        fill = None
        request = call.request
        if request.cache is not None and not request.cache.fill:
            with self._lock:
                filled = self._fills.get(fill_key(call.peer_id, request))
            if filled is None or filled.receipt.request != call.receipt.fill:
                return None
            fill = as_evidence(filled).without_answer()
        return as_evidence(call, fill)

    def sample(self) -> list[CallEvidence]:
        """The kept calls as evidence, oldest first: what this client hands to an auditor."""
        with self._lock:
            kept = list(self._kept)
        return [evidence for evidence in map(self.evidence, kept) if evidence is not None]

    def clear_sample(self) -> None:
        with self._lock:
            self._kept.clear()
            self._kept_bytes = 0


def fill_key(peer: str, request: ForwardRequest) -> FillKey:
    return peer, request.session_id, request.start, request.end, request.cache.version


def as_evidence(call: SignedCall, fill: Optional[CallEvidence] = None) -> CallEvidence:
    request = call.request
    return CallEvidence(call.receipt, request.start, request.end, request.session_id, request.step, request.cache,
                        request.head.to_dict() if request.head is not None else None, request.adapter, call.hidden,
                        call.answer, fill)


def save_sample(sample: list[CallEvidence], directory: Path) -> list[Path]:
    """Write each evidence as ``DIR/<request digest>.evidence`` (one call, one file); the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for evidence in sample:
        path = directory / f"{evidence.receipt.request.hex()[:32]}{SUFFIX}"
        path.write_bytes(evidence.to_bytes())
        paths.append(path)
    return paths
