"""Handing a call's evidence to an auditor over libp2p (issue 55): the messages both ends share.

A client sends one :class:`~swarm.wire.evidence.CallEvidence` per call of the auditor's
:class:`~swarm.wire.services.EvidenceService` stream RPC: a first message whose metadata is the header
``{"bytes": N, "work": STAMP}`` (the evidence's size, and a work stamp of :data:`HANDOFF_BITS` bits minted for the
auditor's peer id, :mod:`swarm.wire.work`; ``None`` from a client the auditor trusts), then the evidence's bytes in
messages of at most :data:`CHUNK_BYTES`. The auditor reads the header first, refuses what its size or stamp does not
allow before reading anything more, then at most ``N`` bytes, and answers one message: ``{"queued": true}`` or an
error (:mod:`swarm.audit.handoff`).

Why a stamp: each piece of evidence costs the auditor a pass of the call's blocks, and peer ids are free; a stamp of
16 bits (about 65,000 hashes, a tenth of a second of one core) per piece prices flooding an auditor in CPU, and the
auditor's queue is bounded and fair by caller besides (:mod:`swarm.audit.handoff`).
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Callable, Optional

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from swarm.wire.encoding import STREAM_CHUNK_BYTES, check_error, parse_metadata
from swarm.wire.evidence import MAX_EVIDENCE_BYTES
from swarm.wire.messages import ErrorCode, RemoteError
from swarm.wire.remote import as_remote_error, read_stream
from swarm.wire.services import EvidenceService
from swarm.wire.work import WorkStamp, mint, parse_work

HANDOFF_BITS = 16  # the work a client proves per piece of evidence (an auditor's trusted clients need prove none)
MAX_PER_HANDOFF = 8  # pieces a client hands one auditor at a time (a random choice of its sample), as many as an
# auditor keeps waiting per caller
CHUNK_BYTES = STREAM_CHUNK_BYTES
UID = "evidence"


@dataclasses.dataclass(frozen=True)
class Header:
    """What the first message declares: the evidence's size in bytes, and the stamp that pays for its recomputation."""

    size: int
    work: Optional[WorkStamp]

    def message(self) -> runtime_pb2.ExpertRequest:
        work = self.work.to_dict() if self.work is not None else None
        return runtime_pb2.ExpertRequest(uid=UID, metadata=MSGPackSerializer.dumps({"bytes": self.size, "work": work}))

    @classmethod
    def parse(cls, message: runtime_pb2.ExpertRequest, max_bytes: int = MAX_EVIDENCE_BYTES) -> "Header":
        """The header of a hand-off from the network; :class:`RemoteError` (bad_request, too_large) otherwise."""
        if message.uid != UID or message.tensors:
            raise RemoteError(ErrorCode.BAD_REQUEST, f"a hand-off starts with a header message (uid {UID!r}, no "
                              "tensors)")
        metadata = parse_metadata(message.metadata)
        if set(metadata) != {"bytes", "work"}:
            raise RemoteError(ErrorCode.BAD_REQUEST, "a hand-off's header is a map of exactly bytes and work")
        size = metadata["bytes"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise RemoteError(ErrorCode.BAD_REQUEST, "a hand-off's 'bytes' is a positive integer")
        if size > max_bytes:
            raise RemoteError(ErrorCode.TOO_LARGE, f"evidence of {size} bytes is over the limit of {max_bytes}")
        work = parse_work(metadata["work"]) if metadata["work"] is not None else None
        return cls(size, work)


def chunk_messages(data: bytes) -> list[runtime_pb2.ExpertRequest]:
    """The body of a hand-off: ``data`` in messages of at most :data:`CHUNK_BYTES`."""
    return [runtime_pb2.ExpertRequest(uid=UID, metadata=data[offset:offset + CHUNK_BYTES])
            for offset in range(0, len(data), CHUNK_BYTES)]


async def read_body(messages: AsyncIterator[runtime_pb2.ExpertRequest], size: int,
                    hold: Callable[[int], None] = lambda count: None) -> bytes:
    """Exactly ``size`` bytes of a hand-off's body, read message by message (``hold`` is told of each chunk's bytes
    before they are kept, and may refuse them); :class:`RemoteError` when the stream carries more, less, or anything
    but body chunks."""
    data = bytearray()
    async for message in messages:
        if message.uid != UID or message.tensors or not message.metadata:
            raise RemoteError(ErrorCode.BAD_REQUEST, "a hand-off's body is chunks of bytes in metadata, nothing else")
        if len(data) + len(message.metadata) > size:
            raise RemoteError(ErrorCode.TOO_LARGE, f"the evidence runs past the {size} bytes its header declared")
        hold(len(message.metadata))
        data += message.metadata
        if len(data) == size:
            return bytes(data)
    raise RemoteError(ErrorCode.INCOMPLETE, f"the evidence ended after {len(data)} of {size} bytes")


async def hand_evidence(p2p: P2P, auditor: str, data: bytes, stamped: bool, timeout: float) -> None:
    """Send one piece of evidence (its bytes) to the auditor of peer id ``auditor`` from ``p2p``'s identity, with a
    stamp unless ``stamped`` is False (an auditor that trusts this client); :class:`RemoteError` when it refuses."""
    caller = str(p2p.peer_id)
    work = await asyncio.to_thread(mint, auditor, caller, HANDOFF_BITS) if stamped else None
    messages = [Header(len(data), work).message(), *chunk_messages(data)]

    async def send() -> None:
        async def stream() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            for message in messages:
                yield message

        stub = EvidenceService.get_stub(p2p, PeerID.from_base58(auditor))
        answers = await read_stream(stub.rpc_hand_evidence(stream()))
        if not answers:
            raise RemoteError(ErrorCode.INCOMPLETE, "the auditor answered nothing", auditor)
        metadata = parse_metadata(answers[0].metadata)
        check_error(metadata, auditor)
        if metadata.get("queued") is not True:
            raise RemoteError(ErrorCode.INTERNAL, "the auditor did not say it queued the evidence", auditor)

    try:
        await asyncio.wait_for(send(), timeout)
    except Exception as error:  # unreachable, timed out, a daemon's error: one error type, naming the auditor
        raise as_remote_error(error, auditor) from error
