"""Hostile and malformed requests sent straight to a live server: each gets a clear error, none harms it."""
from __future__ import annotations

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from swarm.wire.encoding import request_parts
from swarm.wire.messages import ErrorCode, ForwardRequest, RemoteError
from swarm.wire.remote import read_stream
from swarm.wire.services import SpanService
from tests.conftest import raw_answer

HIDDEN = 32  # tiny_config's hidden size


@pytest.fixture(scope="module")
def target(local_swarm):
    return next(p for p in local_swarm.processes if p.span == (0, 2))


def send(remote_lm, peer_id: str, parts: list, stream: bool = False):
    """Send raw request parts and decode the reply (raises RemoteError on a structured error)."""
    stub = SpanService.get_stub(remote_lm.p2p, PeerID.from_base58(peer_id))

    async def call():
        if stream or len(parts) > 1:
            async def parts_iter():
                for part in parts:
                    yield part
            return await read_stream(stub.rpc_forward_stream(parts_iter()))
        return [await stub.rpc_forward(parts[0], timeout=20)]

    return raw_answer(lambda: remote_lm.loop.run(call(), timeout=30), peer_id)


def valid_parts(hidden=None, **metadata):
    hidden = torch.randn(1, 5, HIDDEN) if hidden is None else hidden
    parts = request_parts(ForwardRequest(0, 2, hidden, "session-1", 0))
    if metadata:
        meta = MSGPackSerializer.loads(parts[0].metadata)
        meta.update(metadata)
        parts[0].metadata = MSGPackSerializer.dumps(meta)
    return parts


def with_tensor(tensor_proto, **metadata):
    meta = {"start": 0, "end": 2, "session_id": "s", "step": 0, "extra": {}, "parts": 1, **metadata}
    return [runtime_pb2.ExpertRequest(uid="forward", tensors=[tensor_proto], metadata=MSGPackSerializer.dumps(meta))]


def huge_shape_tensor():
    proto = request_parts(ForwardRequest(0, 2, torch.randn(1, 2, HIDDEN)))[0].tensors[0]
    del proto.size[:]
    proto.size.extend([1, 2**31 - 1, HIDDEN])
    return proto


def corrupt_buffer_tensor():
    proto = request_parts(ForwardRequest(0, 2, torch.randn(1, 4, HIDDEN)))[0].tensors[0]
    proto.buffer = proto.buffer[: len(proto.buffer) // 2]
    return proto


def int_tensor():
    from hivemind.compression import serialize_torch_tensor

    return serialize_torch_tensor(torch.ones(1, 3, HIDDEN, dtype=torch.int64))


PEER = "QmS5ySqvz7QvrZgykvxn9PyHfcHrqNbkDbNXhcGQKwjUeT"  # a well-formed peer id of nobody here


def push_spec(**changes):
    return {"route": [], "reply_to": PEER, "namespace": "ns", "id": "push-1", "hop_delay": [0, 0], **changes}


HOSTILE = {
    "wrong dtype": (lambda: with_tensor(int_tensor()), ErrorCode.BAD_REQUEST),
    "wrong hidden size": (lambda: valid_parts(torch.randn(1, 5, HIDDEN + 1)), ErrorCode.BAD_REQUEST),
    "wrong rank": (lambda: valid_parts(torch.randn(5, HIDDEN)), ErrorCode.BAD_REQUEST),
    "oversized batch": (lambda: valid_parts(torch.randn(40, 500, HIDDEN)), ErrorCode.TOO_LARGE),
    "longer than the context": (lambda: valid_parts(torch.randn(1, 600, HIDDEN)), ErrorCode.TOO_LARGE),
    "huge declared length": (lambda: with_tensor(huge_shape_tensor()), ErrorCode.TOO_LARGE),
    "corrupt buffer": (lambda: with_tensor(corrupt_buffer_tensor()), ErrorCode.BAD_REQUEST),
    "NaN": (lambda: valid_parts(torch.full((1, 3, HIDDEN), float("nan"))), ErrorCode.NOT_FINITE),
    "infinity": (lambda: valid_parts(torch.full((1, 3, HIDDEN), float("inf"))), ErrorCode.NOT_FINITE),
    "blocks not held": (lambda: valid_parts(start=2, end=4), ErrorCode.WRONG_SPAN),
    "negative blocks": (lambda: valid_parts(start=-1, end=2), ErrorCode.WRONG_SPAN),
    "garbage metadata": (lambda: [runtime_pb2.ExpertRequest(uid="forward", metadata=b"\xc1\xff\x00garbage")],
                         ErrorCode.BAD_REQUEST),
    "metadata not a map": (lambda: [runtime_pb2.ExpertRequest(uid="forward", metadata=MSGPackSerializer.dumps([1, 2]))],
                           ErrorCode.BAD_REQUEST),
    "string span": (lambda: valid_parts(start="0", end="2"), ErrorCode.BAD_REQUEST),
    "bad session id": (lambda: valid_parts(session_id={"not": "a string"}), ErrorCode.BAD_REQUEST),
    "overlong session id": (lambda: valid_parts(session_id="x" * 10_000), ErrorCode.BAD_REQUEST),
    "missing tensor": (lambda: with_tensor(runtime_pb2.Tensor(), parts=0), ErrorCode.BAD_REQUEST),
    "truncated stream": (lambda: valid_parts(torch.randn(1, 5, HIDDEN), parts=3), ErrorCode.INCOMPLETE),
    "empty batch": (lambda: valid_parts(torch.randn(0, 5, HIDDEN)), ErrorCode.BAD_REQUEST),
    "cache directive not a map": (lambda: valid_parts(extra={"cache": 5}), ErrorCode.BAD_REQUEST),
    "cache rows reversed": (lambda: valid_parts(extra={"cache": {"rows": [3, 1], "version": 1}}),
                            ErrorCode.BAD_REQUEST),
    "cache rows not the rows sent": (lambda: valid_parts(extra={"cache": {"rows": [0, 2], "version": 1}}),
                                     ErrorCode.BAD_REQUEST),
    "cache without a session": (lambda: valid_parts(session_id="", extra={"cache": {"rows": None, "version": 1}}),
                                ErrorCode.BAD_REQUEST),
    "cache without a version": (lambda: valid_parts(extra={"cache": {"rows": None}}), ErrorCode.BAD_REQUEST),
    "cache version negative": (lambda: valid_parts(extra={"cache": {"rows": None, "version": -1}}),
                               ErrorCode.BAD_REQUEST),
    "cache version a boolean": (lambda: valid_parts(extra={"cache": {"rows": None, "version": True}}),
                                ErrorCode.BAD_REQUEST),
    "cache version huge": (lambda: valid_parts(extra={"cache": {"rows": None, "version": 2**40}}),
                           ErrorCode.BAD_REQUEST),
    "cache keep_from past version": (lambda: valid_parts(extra={"cache": {"rows": None, "version": 1, "keep_from": 2}}),
                                     ErrorCode.BAD_REQUEST),
    "cache reuse never filled": (lambda: valid_parts(session_id="never-filled",
                                                     extra={"cache": {"rows": [0, 5], "version": 1}}),
                                 ErrorCode.CACHE_MISS),
    "push route not a list": (lambda: valid_parts(extra={"push": push_spec(route=3)}), ErrorCode.BAD_REQUEST),
    "push route skips blocks": (lambda: valid_parts(extra={"push": push_spec(route=[[PEER, 3, 4]])}),
                                ErrorCode.BAD_REQUEST),
    "push to a bad peer id": (lambda: valid_parts(extra={"push": push_spec(route=[["not-a-peer", 2, 4]])}),
                              ErrorCode.BAD_REQUEST),
    "push hop delay too long": (lambda: valid_parts(extra={"push": push_spec(hop_delay=[60, 0])}),
                                ErrorCode.BAD_REQUEST),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_request_gets_clear_error_and_server_keeps_serving(remote_lm, target, kind):
    make, code = HOSTILE[kind]
    with pytest.raises(RemoteError) as caught:
        send(remote_lm, target.peer_id, make())
    assert caught.value.code == code, str(caught.value)
    assert caught.value.message
    hidden = torch.randn(1, 5, HIDDEN)
    output, _ = send(remote_lm, target.peer_id, valid_parts(hidden))
    assert output.shape == hidden.shape and torch.isfinite(output).all()
    assert target.alive


def test_truncated_stream_of_a_large_payload_is_refused(remote_lm, target):
    parts = request_parts(ForwardRequest(0, 2, torch.randn(24, 500, HIDDEN), "s", 0))
    assert len(parts) > 2, "payload should be large enough to be streamed"
    with pytest.raises(RemoteError, match="parts"):
        send(remote_lm, target.peer_id, parts[:-1], stream=True)
    output, _ = send(remote_lm, target.peer_id, parts, stream=True)
    assert output.shape == (24, 500, HIDDEN)


def test_backend_refuses_beyond_its_queue_bounds():
    """Limits on requests and queued tokens give a distinct BUSY error instead of unbounded queueing. Both bursts
    run on one event loop, as a server's do: run on two (``asyncio.run`` each), the first loop could close before
    the compute thread's "free" reached it, and the second burst then waited for a thread marked busy for ever (a
    300 s timeout in one `.ci/run`)."""
    import asyncio

    from swarm.models.modules import BlockSpan
    from swarm.server.backend import SpanBackend, SpanCall
    from tests.conftest import tiny_config

    backend = SpanBackend(BlockSpan(tiny_config(), 0, 2), max_concurrent=2, max_queued_tokens=100)

    async def burst(shapes):
        calls = [backend.forward(SpanCall(torch.randn(b, n, HIDDEN), 0, 2)) for b, n in shapes]
        return await asyncio.gather(*calls, return_exceptions=True)

    async def both() -> tuple[list, list]:
        by_requests = await burst([(1, 10)] * 3)
        by_tokens = await burst([(1, 60), (1, 60)])
        for _ in range(500):  # the answered calls' places are released a loop turn or two after their answers
            if backend.in_flight == 0 and backend.queued_tokens == 0:
                break
            await asyncio.sleep(0.01)
        return by_requests, by_tokens

    try:
        by_requests, by_tokens = asyncio.run(asyncio.wait_for(both(), 60))
        busy = [r for r in by_requests if isinstance(r, RemoteError)]
        assert len(busy) == 1 and busy[0].code == ErrorCode.BUSY and "requests" in busy[0].message
        busy = [r for r in by_tokens if isinstance(r, RemoteError)]
        assert len(busy) == 1 and "tokens" in busy[0].message
        assert backend.in_flight == 0 and backend.queued_tokens == 0
    finally:
        backend.shutdown()
