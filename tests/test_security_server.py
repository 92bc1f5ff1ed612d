"""A hostile swarm, server side: every resource a remote peer can make a server spend is bounded.

Network tests run one real server process (tiny model, small limits) and attack it from two bare libp2p
peers, as any client could; unit tests check the admission rules and the activation cache's accounting.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import AsyncIterator, Callable

import psutil
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from swarm.models.modules import BlockSpan
from swarm.protocol import (
    MAX_METADATA_BYTES,
    MAX_STREAM_MESSAGE_BYTES,
    ErrorCode,
    ForwardRequest,
    RemoteError,
    SpanService,
    collect_ack,
    collect_response,
    encode_tensor,
    request_parts,
    tensor_wire_bytes,
)
from swarm.remote import RemoteCaller
from swarm.server.backend import Admission, ComputeQueue
from swarm.server.session_cache import SessionCaches
from swarm.utils.event_loop import BackgroundLoop
from swarm.utils.local_swarm import LocalSwarm, ManagedProcess
from tests.conftest import tiny_config
from tests.silent_delivery import add_silent_delivery

HIDDEN = 32  # tiny_config's hidden size
LIMITS = {  # small enough to reach in a test, large enough for a unary answer over 1 MiB
    "--max-batch-tokens": 16384, "--max-concurrent-requests": 4, "--max-queued-tokens": 32768,
    "--peer-share": 0.5, "--max-pending-pushes": 4, "--push-timeout": 3,
}


class Peer:
    """A bare libp2p peer connected to the server, calling its RPCs as any client could."""

    def __init__(self, server: ManagedProcess):
        self.server = server
        self.loop = BackgroundLoop(name="hostile-peer")
        self.p2p: P2P = self.loop.run(P2P.create(initial_peers=server.maddrs), timeout=60)
        self.peer_id = str(self.p2p.peer_id)
        self.caller = RemoteCaller(self.p2p)
        self.stub = SpanService.get_stub(self.p2p, PeerID.from_base58(server.peer_id))

    def run(self, coroutine, timeout: float = 60):
        return self.loop.run(coroutine, timeout)

    def info(self) -> dict:
        return self.run(self.caller.info(self.server.peer_id, 10))[0]

    def unary(self, part: runtime_pb2.ExpertRequest, collect: Callable = collect_response):
        return collect([self.run(self.stub.rpc_forward(part, timeout=30))], self.server.peer_id)

    def stream(self, parts: list[runtime_pb2.ExpertRequest], collect: Callable = collect_response):
        async def call() -> list:
            return [r async for r in await self.stub.rpc_forward_stream(_aiter(parts))]

        return collect(self.run(call()), self.server.peer_id)

    def hold(self, first: runtime_pb2.ExpertRequest):
        """Send a stream's first part and nothing more, until the returned future is cancelled (which
        closes the stream)."""
        async def call() -> list:
            responses = await self.stub.rpc_forward_stream(_aiter([first], stall=True))
            async with contextlib.aclosing(responses):
                return [r async for r in responses]

        return asyncio.run_coroutine_threadsafe(call(), self.loop.loop)

    def silent_target(self) -> str:
        """A delivery namespace whose handler accepts each stream and never reads it."""
        return self.run(add_silent_delivery(self.p2p, f"silent-{self.peer_id[-6:]}"))

    def close(self) -> None:
        self.run(self.p2p.shutdown(), timeout=30)
        self.loop.stop()


async def _aiter(parts: list, stall: bool = False) -> AsyncIterator:
    for part in parts:
        yield part
    if stall:
        await asyncio.sleep(3600)


@pytest.fixture(scope="module")
def server(tiny_model_path):
    with LocalSwarm() as swarm:
        flags = [str(v) for item in LIMITS.items() for v in item]
        yield swarm.start_server(str(tiny_model_path), "0:2", "--compute-threads", "1", *flags)


@pytest.fixture(scope="module")
def alice(server):
    peer = Peer(server)
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def bob(server):
    peer = Peer(server)
    yield peer
    peer.close()


def forward(hidden: torch.Tensor, **extra) -> ForwardRequest:
    return ForwardRequest(0, 2, hidden, "session", 0, extra)


def stream_parts(hidden: torch.Tensor, chunk: int = 2**16) -> list[runtime_pb2.ExpertRequest]:
    """A request split into many small parts (as a client with hivemind's default chunk size would)."""
    chunks = list(split_for_streaming(encode_tensor(hidden), chunk))
    metadata = {"start": 0, "end": 2, "session_id": "s", "step": 0, "extra": {}, "parts": len(chunks)}
    return ([runtime_pb2.ExpertRequest(uid="forward", tensors=[chunks[0]], metadata=MSGPackSerializer.dumps(metadata))]
            + [runtime_pb2.ExpertRequest(tensors=[c]) for c in chunks[1:]])


def one_part(hidden: torch.Tensor) -> runtime_pb2.ExpertRequest:
    """A request in one message, whatever its size."""
    metadata = {"start": 0, "end": 2, "session_id": "s", "step": 0, "extra": {}, "parts": 1}
    return runtime_pb2.ExpertRequest(uid="forward", tensors=[encode_tensor(hidden)],
                                     metadata=MSGPackSerializer.dumps(metadata))


def wait_until(condition: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def refused(call: Callable[[], object]) -> RemoteError:
    with pytest.raises(RemoteError) as caught:
        call()
    return caught.value


def assert_serves(peer: Peer) -> None:
    hidden = torch.randn(1, 5, HIDDEN)
    output, _ = peer.unary(request_parts(forward(hidden))[0])
    assert output.shape == hidden.shape and peer.server.alive


# ----- against a live server ---------------------------------------------------------------------
def test_pushes_to_a_target_that_never_reads_are_bounded_and_dropped(alice, bob):
    """Each peer may hold half of --max-pending-pushes; a push the target does not take within
    --push-timeout is dropped and its place freed."""
    def push(peer: Peer, namespace: str, index: int):
        spec = {"route": [], "reply_to": peer.peer_id, "namespace": namespace, "id": f"p{index}",
                "hop_delay": [0, 0]}
        return peer.unary(request_parts(forward(torch.randn(1, 64, HIDDEN), push=spec))[0], collect_ack)

    target_a, target_b = alice.silent_target(), bob.silent_target()
    before = alice.info()["push"]
    push(alice, target_a, 1)
    push(alice, target_a, 2)
    error = refused(lambda: push(alice, target_a, 3))
    assert error.code == ErrorCode.BUSY and "this peer holds 2 pushes" in error.message
    push(bob, target_b, 4)  # the other half stays free for others
    wait_until(lambda: alice.info()["push"]["pending"]["in_flight"] == 0)
    after = alice.info()["push"]
    assert after["dropped"] - before["dropped"] == 3 and after["delivered"] == before["delivered"]
    assert after["pending"]["bytes"] == 0
    push(alice, target_a, 5)  # freed: accepted again
    assert_serves(alice)


def test_one_peer_cannot_take_every_compute_slot(alice, bob):
    """Requests hold their place from their first part: a peer stalling streams gets at most its share
    (here 2 of 4), and another peer is still served."""
    first = stream_parts(torch.randn(1, 2048, HIDDEN))[0]
    held = [alice.hold(first) for _ in range(2)]
    try:
        wait_until(lambda: alice.info()["admission"]["span"]["in_flight"] == 2)
        error = refused(lambda: alice.stream(stream_parts(torch.randn(1, 2048, HIDDEN))))
        assert error.code == ErrorCode.BUSY and "this peer holds 2 requests" in error.message
        assert_serves(bob)
    finally:
        for future in held:
            future.cancel()
    wait_until(lambda: alice.info()["admission"]["span"]["in_flight"] == 0)  # a cut stream frees its place
    assert_serves(alice)


def test_garbage_metadata_gets_a_specific_message(alice):
    error = refused(lambda: alice.unary(runtime_pb2.ExpertRequest(uid="forward", metadata=b"\xc1\xff\x00garbage")))
    assert error.code == ErrorCode.BAD_REQUEST
    assert "FormatError: Invalid msgpack format" in error.message and "c1ff00" in error.message
    huge = runtime_pb2.ExpertRequest(uid="forward", metadata=MSGPackSerializer.dumps({"x": "y" * MAX_METADATA_BYTES}))
    assert refused(lambda: alice.unary(huge)).code == ErrorCode.TOO_LARGE
    assert_serves(alice)


@pytest.mark.parametrize("kind", ["declared shape over the limit", "more bytes than declared",
                                  "one message over the stream limit", "answer too large for unary"])
def test_oversized_requests_are_refused_before_compute(alice, kind):
    """The server decides from the first part and never computes (``rows_computed`` stays put); the caller
    hears too_large, not a broken pipe."""
    computed = alice.info()["rows_computed"]
    if kind == "declared shape over the limit":  # 6 MiB in 96 parts, refused at the first
        error = refused(lambda: alice.stream(stream_parts(torch.randn(1, 49152, HIDDEN))))
        assert "exceeds this server's limit of 16384" in error.message
    elif kind == "more bytes than declared":  # declares 16 positions, then keeps sending
        parts = stream_parts(torch.randn(1, 16, HIDDEN))
        parts[0].metadata = MSGPackSerializer.dumps(dict(MSGPackSerializer.loads(parts[0].metadata), parts=30))
        filler = stream_parts(torch.randn(1, 16384, HIDDEN))[1:30]
        error = refused(lambda: alice.stream(parts + filler))
        assert "payload over" in error.message
    elif kind == "one message over the stream limit":  # 3 MiB in one message: refused unread
        part = one_part(torch.randn(1, 3 * 2**20 // (4 * HIDDEN), HIDDEN))
        assert part.ByteSize() > MAX_STREAM_MESSAGE_BYTES
        error = refused(lambda: alice.stream([part]))
        assert "stream message of" in error.message
    else:  # 1.5 MiB of hidden states in one unary message: the answer would need a stream
        error = refused(lambda: alice.unary(one_part(torch.randn(1, 12288, HIDDEN))))
        assert "does not fit a unary call" in error.message
    assert error.code == ErrorCode.TOO_LARGE
    assert alice.info()["rows_computed"] == computed
    assert_serves(alice)


# ----- admission rules ---------------------------------------------------------------------------
def test_admission_gives_each_peer_at_most_its_share():
    admission = Admission("requests", max_count=4, max_amount=100, peer_share=0.5)
    a1, a2 = admission.acquire("a", 10), admission.acquire("a", 10)
    with pytest.raises(RemoteError, match="this peer holds 2 requests"):
        admission.acquire("a", 10)
    b1 = admission.acquire("b", 45)
    with pytest.raises(RemoteError, match="its share of 50"):
        admission.acquire("b", 10)
    big = admission.acquire("c", 30)  # a peer holding nothing is admitted within the global bounds
    with pytest.raises(RemoteError, match="4 requests in flight"):
        admission.acquire("d", 1)
    for grant in (a1, a2, b1, big):
        grant.release()
        grant.release()  # a second release does nothing
    assert (admission.count, admission.amount, dict(admission.peer_counts)) == (0, 0, {})
    with admission.acquire("a", 500):  # the first request of an idle server runs whatever its size
        assert admission.amount == 500


def test_a_timed_out_request_keeps_its_place_until_it_leaves_the_compute_thread():
    queue = ComputeQueue(max_concurrent=1)

    async def scenario() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(queue.run(1, time.sleep, 0.5, peer="a"), 0.05)
        assert queue.in_flight == 1  # the thread still runs it: the bound still counts it
        with pytest.raises(RemoteError, match="1 requests in flight"):
            await queue.run(1, time.sleep, 0, peer="b")
        await asyncio.sleep(0.7)
        assert queue.in_flight == 0
        await queue.run(1, time.sleep, 0, peer="b")

    try:
        asyncio.run(scenario())
    finally:
        queue.shutdown()


# ----- the activation cache's accounting ---------------------------------------------------------
def measure_tiny_fills() -> dict:
    """14,000 one-position fills, each a new session, as a flood would send them; checks what the cache counts
    and returns how much the process's resident memory grew for them."""
    config = tiny_config()
    span = BlockSpan(config, 0, 1).eval()
    budget = 8 * 2**20
    hidden = torch.randn(1, 1, HIDDEN)

    def fill(caches: SessionCaches, session: str) -> None:
        kv = caches.for_fill(session, 1, 0, 1, 1, 1)
        span(hidden, kv=kv)
        caches.filled(session, 1, kv, ok=True)

    with torch.inference_mode():
        warm = SessionCaches(config, budget, ttl=600)
        for index in range(200):  # warm up the allocator and torch first
            fill(warm, f"warm-{index}")
        del warm
        caches = SessionCaches(config, budget, ttl=600, max_entries=10**6)
        gc.collect()
        before = psutil.Process().memory_info().rss
        for index in range(14_000):
            fill(caches, f"session-{index:06d}")
        gc.collect()
        grown = psutil.Process().memory_info().rss - before
    kept = len(caches.entries)
    assert caches.used_bytes <= budget and caches.stats.evictions == 14_000 - kept
    assert caches.used_bytes == sum(entry.size for entry in caches.entries.values())
    assert caches.cost_of(1, 1, 1) > caches.size_of(1, 1, 1)  # the overhead is counted, not just the tensors
    return {"kept": kept, "used_bytes": caches.used_bytes, "grown": grown, "budget": budget}


def test_tiny_cache_fills_are_counted_at_their_real_cost():
    """What the cache counts stays within its budget, and so does the memory the process really holds for the
    fills. Measured in a fresh process: in the test process, the threads, servers and models of earlier tests
    move the resident size by tens of MB on their own (seen once in a full run: 37 MB)."""
    code = "import json; from tests.test_security_server import measure_tiny_fills as m; print(json.dumps(m()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["grown"] <= result["budget"], (
        f"{result['kept']} versions counted at {result['used_bytes']} bytes hold {result['grown']} bytes")


def test_cache_versions_are_bounded_in_count_and_expire_from_the_oldest():
    config = tiny_config()
    caches = SessionCaches(config, budget_bytes=10**9, ttl=0.2, max_entries=3)
    for session in "abcd":
        caches.filled(session, 1, caches.for_fill(session, 1, 0, 2, 1, 4), ok=True)
    assert caches.sessions == {"b", "c", "d"} and caches.stats.evictions == 1
    asyncio.run(caches.for_reuse("b", 1))  # b becomes the most recently used
    caches.filled("e", 1, caches.for_fill("e", 1, 0, 2, 1, 4), ok=True)
    assert caches.sessions == {"b", "d", "e"}  # c was the least recently used
    time.sleep(0.25)
    caches.expire()
    assert not caches.entries and caches.used_bytes == 0 and not caches.versions


def test_the_unary_answer_size_is_known_before_encoding():
    for wire_dtype in ("float32", "float16"):
        for shape in [(1, 1, 1), (1, 5, 32), (2, 4096, 32), (1, 8191, 32), (3, 17, 128)]:
            assert tensor_wire_bytes(shape, wire_dtype) == encode_tensor(torch.zeros(shape), wire_dtype).ByteSize()
