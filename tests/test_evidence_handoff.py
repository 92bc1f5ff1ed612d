"""Evidence handed to an auditor over libp2p (issue 55; swarm/wire/handoff.py, swarm/audit/handoff.py): the auditor's
endpoint is hostile input. The header is parsed and refused on its own (size, stamp, the caller's share) before any
body is read; the body is read to exactly its declared size and parsed as evidence; the queue is bounded and fair by
caller, trusted clients first; strangers pay a work stamp per piece, each spent once. Unit tests: no socket, no
process (the handler is driven with in-process message streams); a liar caught through evidence sent over a real
network is in tests/test_audit_traffic.py."""
from __future__ import annotations

import asyncio
from typing import Iterable

import pytest
import torch
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.audit.handoff import MAX_READING_BYTES, EvidenceInbox, EvidenceQueue
from swarm.wire.encoding import encode_tensor
from swarm.wire.evidence import MAX_EVIDENCE_BYTES, CallEvidence
from swarm.wire.handoff import CHUNK_BYTES, UID, Header, chunk_messages, read_body
from swarm.wire.messages import ErrorCode, RemoteError
from swarm.wire.receipts import ReceiptSigner, tensor_digest
from swarm.wire.work import mint

pytestmark = pytest.mark.unit

AUDITOR, CLIENT, NOW = "auditor-peer", "client-peer", 1_700_000_000.0
BITS = 12  # the tests' stamps (the default, HANDOFF_BITS, is 18: a fraction of a second each)


@pytest.fixture(scope="module")
def evidence_bytes() -> bytes:
    """A well-formed piece of evidence (a signed call of random content: the endpoint parses, it does not judge)."""
    signer = ReceiptSigner(RSAPrivateKey(), "handoff-model", exact=True, invariant=True)
    hidden, answer = encode_tensor(torch.randn(1, 4, 8)), encode_tensor(torch.randn(1, 4, 8))
    receipt = signer.sign(b"r" * 32, tensor_digest(answer))
    return CallEvidence(receipt, 0, 2, "session", 3, None, None, None, hidden, answer).to_bytes()


def messages_of(*parts: runtime_pb2.ExpertRequest, after: Iterable = ()):
    """An in-process request stream; ``after`` raises if the handler reads past the parts given."""
    async def stream():
        for part in parts:
            yield part
        for item in after:
            raise AssertionError(f"the handler read past its refusal: {item}")
    return stream()


def hand(inbox: EvidenceInbox, data: bytes, caller: str = CLIENT, work=None, now: float = NOW) -> None:
    asyncio.run(inbox.receive(messages_of(Header(len(data), work).message(), *chunk_messages(data)), caller,
                              AUDITOR, now))


def stamp(caller: str = CLIENT, bits: int = BITS, salt: str = "0123456789abcdef"):
    return mint(AUDITOR, caller, bits, NOW, salt)


# ----- the header, the body ----------------------------------------------------------------------------------------
def test_the_header_reads_back_and_everything_else_is_refused_clearly():
    work = stamp()
    assert Header.parse(Header(1000, work).message()) == Header(1000, work)
    assert Header.parse(Header(1, None).message()) == Header(1, None)
    bad = {"bytes": 0, "work": None}, {"bytes": True, "work": None}, {"bytes": "9", "work": None}, \
        {"bytes": 9}, {"bytes": 9, "work": None, "x": 1}, {"bytes": 9, "work": {"epoch": 1}}
    for metadata in bad:
        with pytest.raises(RemoteError) as refused:
            Header.parse(runtime_pb2.ExpertRequest(uid=UID, metadata=MSGPackSerializer.dumps(metadata)))
        assert refused.value.code == ErrorCode.BAD_REQUEST and refused.value.message
    with pytest.raises(RemoteError, match="over the limit") as refused:
        Header.parse(Header(MAX_EVIDENCE_BYTES + 1, None).message())
    assert refused.value.code == ErrorCode.TOO_LARGE
    with pytest.raises(RemoteError, match="header message"):
        Header.parse(runtime_pb2.ExpertRequest(uid="forward", metadata=Header(9, None).message().metadata))


# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None)
@given(st.one_of(st.binary(max_size=64), st.dictionaries(
    st.sampled_from(["bytes", "work", "x"]),
    st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=16),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                     st.sampled_from(["epoch", "salt", "counter"]), inner, max_size=3), max_leaves=8),
    max_size=3).map(MSGPackSerializer.dumps)), st.sampled_from([UID, "", "forward"]))
def test_the_header_parser_takes_any_bytes_and_answers_a_header_or_a_clear_refusal(metadata, uid):
    try:
        header = Header.parse(runtime_pb2.ExpertRequest(uid=uid, metadata=metadata))
    except RemoteError as error:
        assert error.code in (ErrorCode.BAD_REQUEST, ErrorCode.TOO_LARGE) and error.message
        return
    assert 1 <= header.size <= MAX_EVIDENCE_BYTES


def test_the_body_is_exactly_the_declared_bytes():
    data = bytes(range(256)) * (CHUNK_BYTES // 128)  # two chunks
    assert asyncio.run(read_body(messages_of(*chunk_messages(data)), len(data))) == data
    with pytest.raises(RemoteError, match="runs past") as refused:
        asyncio.run(read_body(messages_of(*chunk_messages(data)), len(data) - 1))
    assert refused.value.code == ErrorCode.TOO_LARGE
    with pytest.raises(RemoteError, match="ended after") as refused:
        asyncio.run(read_body(messages_of(*chunk_messages(data)), len(data) + 1))
    assert refused.value.code == ErrorCode.INCOMPLETE
    with pytest.raises(RemoteError, match="nothing else"):
        asyncio.run(read_body(messages_of(runtime_pb2.ExpertRequest(uid=UID, tensors=[runtime_pb2.Tensor()])), 9))


def test_the_bytes_being_read_are_bounded_across_hand_offs_and_released(evidence_bytes):
    """Counted as they arrive: a hand-off that would take the bytes read and not yet queued past the bound is refused
    busy, and what any hand-off held is released when it ends, queued or refused."""
    inbox = EvidenceInbox(trusted=[CLIENT], bits=BITS)
    inbox.reading = MAX_READING_BYTES - 10  # other hand-offs being read now
    with pytest.raises(RemoteError, match="reading as much") as refused:
        hand(inbox, evidence_bytes)
    assert refused.value.code == ErrorCode.BUSY and inbox.reading == MAX_READING_BYTES - 10
    inbox.reading = 0
    hand(inbox, evidence_bytes)
    assert inbox.reading == 0 and inbox.queue.items == 1


# ----- admission: stamps, trust, bounds ----------------------------------------------------------------------------
def test_a_stranger_pays_a_fresh_stamp_per_piece_and_a_trusted_client_none(evidence_bytes):
    inbox = EvidenceInbox(trusted=["trusted-peer"], bits=BITS)
    with pytest.raises(RemoteError, match=f"work stamp of {BITS} bits"):
        hand(inbox, evidence_bytes)  # no stamp
    with pytest.raises(RemoteError, match="work stamp"):
        hand(inbox, evidence_bytes, work=stamp(bits=BITS - 4))  # too little work (a short stamp may prove more)
    work = stamp()
    hand(inbox, evidence_bytes, work=work)
    with pytest.raises(RemoteError, match="work stamp"):
        hand(inbox, evidence_bytes, work=work)  # spent
    with pytest.raises(RemoteError, match="work stamp"):
        hand(inbox, evidence_bytes, caller="thief", work=work)  # minted for another caller: worth nothing
    hand(inbox, evidence_bytes, caller="trusted-peer")
    taken = inbox.queue.take(64)
    assert [caller for caller, _ in taken] == [CLIENT, "trusted-peer"]
    assert all(evidence.to_bytes() == evidence_bytes for _, evidence in taken)
    closed = EvidenceInbox(trusted=["trusted-peer"], open_to_all=False, bits=BITS)
    with pytest.raises(RemoteError, match="only from the clients it trusts"):
        hand(closed, evidence_bytes, work=stamp(salt="fedcba9876543210"))
    hand(closed, evidence_bytes, caller="trusted-peer")


def test_nothing_past_a_refused_header_is_read(evidence_bytes):
    """A header refused (too large, unpaid, a full share) costs the auditor that one message."""
    inbox = EvidenceInbox(bits=BITS)
    for header in (Header(MAX_EVIDENCE_BYTES + 1, stamp()), Header(len(evidence_bytes), None)):
        with pytest.raises(RemoteError):
            asyncio.run(inbox.receive(messages_of(header.message(), after=["body"]), CLIENT, AUDITOR, NOW))
    with pytest.raises(RemoteError, match="empty hand-off"):
        asyncio.run(inbox.receive(messages_of(), CLIENT, AUDITOR, NOW))
    with pytest.raises(RemoteError, match="not evidence") as refused:
        hand(inbox, b"\x81\xa1v\x01" + bytes(40), work=stamp(salt="00000000000000aa"))
    assert refused.value.code == ErrorCode.BAD_REQUEST and inbox.queue.items == 0


def test_the_queue_is_bounded_and_fair_by_caller_trusted_clients_first():
    queue = EvidenceQueue(max_items=6, max_bytes=10**6, per_caller=4, trusted=["trusted"])
    for index in range(4):
        queue.put("flooder", f"flood-{index}", 10)
    with pytest.raises(RemoteError, match="already wait") as refused:
        queue.put("flooder", "flood-4", 10)  # its share
    assert refused.value.code == ErrorCode.BUSY
    queue.put("sybil-1", "s1", 10)
    queue.put("sybil-2", "s2", 10)  # full now: 6
    queue.put("honest", "h", 10)  # displaces the flooder's newest (it holds the most)
    assert queue.dropped == 1 and queue.items == 6 and len(queue.waiting["flooder"]) == 3
    queue.put("sybil-1", "s1-again", 10)  # 2 against the flooder's 3: the flooder's newest goes again
    with pytest.raises(RemoteError, match="queue is full"):
        queue.put("sybil-1", "s1-third", 10)  # 3 against at most 2 each: no one to displace fairly
    assert {caller: len(held) for caller, held in queue.waiting.items()} == {
        "flooder": 2, "sybil-1": 2, "sybil-2": 1, "honest": 1}
    for index in range(3):
        queue.put("trusted", f"t-{index}", 10)  # a trusted client displaces strangers while they hold any
    with pytest.raises(RemoteError, match="queue is full"):
        queue.put("stranger", "x", 10)  # strangers never displace a trusted client's pieces, nor a fair share
    assert len(queue.waiting["trusted"]) == 3 and queue.items == 6 and queue.dropped == 5
    taken = [evidence for _, evidence in queue.take(4)]
    assert "t-0" in taken and not {"t-1", "t-2"} & set(taken)  # one per caller in turn
    assert queue.items == 2 and queue.bytes == 20
    with pytest.raises(RemoteError, match="over this auditor's queue") as refused:
        EvidenceQueue(max_bytes=100).room("caller", 101)
    assert refused.value.code == ErrorCode.TOO_LARGE


def test_round_robin_takes_one_per_caller_in_turn():
    queue = EvidenceQueue()
    for caller, count in (("a", 3), ("b", 1), ("c", 2)):
        for index in range(count):
            queue.put(caller, f"{caller}{index}", 1)
    assert [evidence for _, evidence in queue.take(5)] == ["a0", "b0", "c0", "a1", "c1"]
    assert [evidence for _, evidence in queue.take(5)] == ["a2"] and queue.items == 0 and not queue.waiting


# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=64).map(lambda data: runtime_pb2.ExpertRequest(uid=UID, metadata=data)),
                          st.builds(lambda size, uid: Header(size, None).message() if uid == UID else
                                    runtime_pb2.ExpertRequest(uid=uid, metadata=MSGPackSerializer.dumps(
                                        {"bytes": size, "work": None})),
                                    st.integers(1, 2**40), st.sampled_from([UID, "x"]))), max_size=6))
def test_the_endpoint_takes_any_stream_and_queues_evidence_or_refuses_it_clearly(parts):
    inbox = EvidenceInbox(trusted=[CLIENT], bits=BITS)
    try:
        asyncio.run(inbox.receive(messages_of(*parts), CLIENT, AUDITOR, NOW))
    except RemoteError as error:
        assert error.message and inbox.reading == 0
        return
    assert inbox.queue.items == 1 and inbox.reading == 0
