"""A hostile swarm, server side: every resource a remote peer can make a server spend is bounded.

Network tests run one real server process (tiny model, small limits) and attack it from bare libp2p peers
(two, or more sybil ids than it has stream places), as any client could; one more server, of a long-context model,
shows that a long pass whose caller has gone is cancelled. Unit tests check the admission rules and the activation
cache's accounting.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator, Callable

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from swarm.dht.node import create_p2p
from swarm.diffusion.pipeline import CacheDirective
from swarm.models.loading import ModelFiles
from swarm.server.backend import Admission, ComputeQueue, attention_length_scale, request_cost
from swarm.server.session_cache import SessionCaches
from swarm.testing.silent_delivery import add_silent_delivery
from swarm.utils.event_loop import BackgroundLoop
from swarm.utils.local_swarm import LocalSwarm, ManagedProcess
from swarm.wire.encoding import (
    MAX_METADATA_BYTES,
    MAX_STREAM_MESSAGE_BYTES,
    collect_ack,
    collect_response,
    encode_tensor,
    request_parts,
    tensor_wire_bytes,
)
from swarm.wire.messages import ErrorCode, ForwardRequest, PushSpec, RemoteError
from swarm.wire.remote import RemoteCaller, read_stream
from swarm.wire.services import SpanService
from tests.conftest import make_checkpoint, raw_answer, stop_all, tiny_config
from tests.tiny_fills import FILLS

HIDDEN = 32  # tiny_config's hidden size
POSITIONS = 512  # tiny_config's context
LIMITS = {  # small enough to reach in a test, large enough for a unary answer over 1 MiB
    "--max-batch-tokens": 16384, "--max-concurrent-requests": 4, "--max-queued-tokens": 262144,
    "--peer-share": 0.5, "--max-pending-pushes": 4, "--push-timeout": 3,
    # 2 stream places per peer, 3 for peers without completed requests, 1 kept for those with some;
    # a stream of 4 x 512 has 4 s to arrive
    "--max-unfinished-streams": 4, "--known-peer-reserve": 0.25, "--receive-timeout": 1, "--receive-rate-mb": 0.1,
}


class Peer:
    """A bare libp2p peer connected to the server, calling its RPCs as any client could."""

    def __init__(self, server: ManagedProcess):
        self.server = server
        self.loop = BackgroundLoop(name="hostile-peer")
        self.p2p: P2P = self.loop.run(create_p2p(server.maddrs), timeout=60)
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
            return await read_stream(self.stub.rpc_forward_stream(_aiter(parts)))

        return raw_answer(lambda: self.run(call()), self.server.peer_id, collect)

    def hold(self, first: runtime_pb2.ExpertRequest):
        """Send a stream's first part and nothing more, until the server answers (a refusal, or the drop at its
        deadline) or the returned future is cancelled (which closes the stream)."""
        return asyncio.run_coroutine_threadsafe(self._stalled(first), self.loop.loop)

    def stall_forever(self, first: runtime_pb2.ExpertRequest):
        """Stall streams one after another, a new one as soon as the server answered the last (refused it, or
        dropped it at its deadline), as a sybil that wants to keep its places would, until the returned future
        is cancelled."""
        async def loop() -> None:
            while True:
                with contextlib.suppress(Exception):
                    await self._stalled(first, until_answered=True)
                await asyncio.sleep(0.2)

        return asyncio.run_coroutine_threadsafe(loop(), self.loop.loop)

    async def _stalled(self, first: runtime_pb2.ExpertRequest, until_answered: bool = False) -> list:
        responses = await self.stub.rpc_forward_stream(_aiter([first], stall=True))
        async with contextlib.aclosing(responses):
            if until_answered:  # the server's answer, then the stream is cut (it would drain it for 10 s)
                return [await anext(responses)]
            return [r async for r in responses]

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
def own_swarm():
    """The file's two servers, forked from one fork server (each a DHT of its own: there is no bootstrap peer); a
    fork server per server cost about 1.5 CPU s more."""
    with LocalSwarm(fork_server=True) as swarm:
        yield swarm
        stop_all(swarm, swarm.processes)  # read by nobody after: no graceful leave to wait for


@pytest.fixture(scope="module")
def server(own_swarm, tiny_model_path):
    flags = [str(v) for item in LIMITS.items() for v in item]
    return own_swarm.start_server(str(tiny_model_path), "0:2", "--compute-threads", "1", *flags)


@pytest.fixture(scope="module")
def long_server(own_swarm, tmp_path_factory):
    """A server of a model with a long context and many blocks, whose requests time out after 2 s: one pass of
    6,144 positions takes it far longer (attention's quadratic term), so a caller gives up while it runs."""
    path = make_checkpoint(tmp_path_factory.mktemp("long"), tiny_config(num_layers=32, max_position_embeddings=8192))
    return own_swarm.start_server(str(path), "0:32", "--compute-threads", "1", "--throughput", "100",
                                  "--request-timeout", "2", "--max-batch-tokens", "8192")


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


def forward(hidden: torch.Tensor, **directives) -> ForwardRequest:
    return ForwardRequest(0, 2, hidden, "session", 0, **directives)


def stream_parts(hidden: torch.Tensor, chunk: int = 2**16, end: int = 2) -> list[runtime_pb2.ExpertRequest]:
    """A request split into many small parts (as a client with hivemind's default chunk size would)."""
    chunks = list(split_for_streaming(encode_tensor(hidden), chunk))
    metadata = {"start": 0, "end": end, "session_id": "s", "step": 0, "extra": {}, "parts": len(chunks)}
    return ([runtime_pb2.ExpertRequest(uid="forward", tensors=[chunks[0]], metadata=MSGPackSerializer.dumps(metadata))]
            + [runtime_pb2.ExpertRequest(tensors=[c]) for c in chunks[1:]])


def one_part(hidden: torch.Tensor, end: int = 2) -> runtime_pb2.ExpertRequest:
    """A request in one message, whatever its size."""
    metadata = {"start": 0, "end": end, "session_id": "s", "step": 0, "extra": {}, "parts": 1}
    return runtime_pb2.ExpertRequest(uid="forward", tensors=[encode_tensor(hidden)],
                                     metadata=MSGPackSerializer.dumps(metadata))


def wait_until(condition: Callable[[], bool], timeout: float = 20) -> None:
    """Wait for ``condition``, an info call to the server each time: every 0.25 s (the states waited for change
    at a stream's deadline, seconds apart)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.25)


def refused(call: Callable[[], object]) -> RemoteError:
    with pytest.raises(RemoteError) as caught:
        call()
    return caught.value


def assert_serves(peer: Peer) -> None:
    hidden = torch.randn(1, 5, HIDDEN)
    output, _ = peer.unary(request_parts(forward(hidden))[0])
    assert output.shape == hidden.shape and peer.server.alive


def span_info(peer: Peer) -> dict:
    """The server's admission counters of its span: compute queue, unfinished streams, cancelled passes."""
    return peer.info()["admission"]["span"]


# ----- against a live server ---------------------------------------------------------------------
@pytest.mark.swarm
def test_pushes_to_a_target_that_never_reads_are_bounded_and_dropped(alice, bob):
    """Each peer may hold half of --max-pending-pushes; a push the target does not take within
    --push-timeout is dropped and its place freed."""
    def push(peer: Peer, namespace: str, index: int):
        spec = PushSpec((), peer.peer_id, namespace, f"p{index}", (0, 0))
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


@pytest.mark.swarm
def test_one_peer_stalling_streams_holds_its_share_of_stream_places_and_no_compute_slot(alice, bob):
    """A stream holds a place among the unfinished streams from its first part until its last: one peer
    stalling streams gets at most its share of those (here 2 of 4), counted at their length-aware cost, and
    no compute slot, so another peer is still served. (The module's two peers: a peer's share is the same whether
    it completed requests before or not, 2 of the 3 places left to newcomers.)"""
    stalling, other = bob, alice
    first = stream_parts(torch.randn(4, POSITIONS, HIDDEN))[0]
    held = [stalling.hold(first) for _ in range(2)]
    try:
        wait_until(lambda: span_info(other)["unfinished"]["in_flight"] == 2)
        info = span_info(other)
        assert info["in_flight"] == 0  # the compute queue is untouched
        scale = attention_length_scale(tiny_config())
        assert info["unfinished"]["tokens"] == 2 * request_cost(4, POSITIONS, scale) > 2 * 4 * POSITIONS
        error = refused(lambda: stalling.stream(stream_parts(torch.randn(4, POSITIONS, HIDDEN))))
        assert error.code == ErrorCode.BUSY and "this peer holds 2 unfinished streams" in error.message
        assert_serves(other)
    finally:
        for future in held:
            future.cancel()
    wait_until(lambda: span_info(other)["unfinished"]["in_flight"] == 0)  # a cut stream frees its place
    assert_serves(stalling)


SYBILS = LIMITS["--max-unfinished-streams"] + 1  # more stalling ids than there are stream places at all


@pytest.mark.swarm
def test_sybils_stalling_streams_do_not_keep_honest_peers_out(server, alice):
    """``SYBILS`` peer ids (each a bare libp2p peer), enough to hold every stream place without the reserve, keep
    stalling streams, each sending its first part only and opening another once the server answered. They hold
    no compute slot, at most the 3 stream places left to peers without completed requests, and each for its
    deadline only (1 s plus its 2 x 512 positions at 0.1 MiB/s: 2.25 s): an unknown peer's unary request and a
    known peer's stream are both served meanwhile, and the stalled streams are counted as dropped."""
    for _ in range(2):  # alice completes requests: she becomes a known peer
        assert_serves(alice)
    before = span_info(alice)
    with ThreadPoolExecutor(8) as pool:  # each peer starts its own libp2p daemon: a second or more apiece
        newcomer, *sybils = pool.map(lambda _: Peer(server), range(SYBILS + 1))  # newcomer: no completed request
    first = stream_parts(torch.randn(2, POSITIONS, HIDDEN))[0]  # 2 parts: the first alone leaves it unfinished
    stalling = [sybil.stall_forever(first) for sybil in sybils]
    try:
        wait_until(lambda: span_info(alice)["unfinished"]["in_flight"] == 3)
        for _ in range(3):
            assert_serves(newcomer)  # a unary call: whole on arrival, it needs no stream place
            hidden = torch.randn(4, POSITIONS, HIDDEN)
            output, _ = alice.stream(stream_parts(hidden))  # a stream from a known peer: the reserved place
            assert output.shape == hidden.shape
            assert span_info(alice)["unfinished"]["in_flight"] <= 4
        wait_until(lambda: span_info(alice)["unfinished"]["dropped"] - before["unfinished"]["dropped"] >= 6, 60)
        during = span_info(alice)
        assert during["unfinished"]["refused"] > before["unfinished"]["refused"]  # sybils beyond the cap
    finally:
        for future in stalling:
            future.cancel()
        for sybil in [*sybils, newcomer]:
            sybil.close()
    wait_until(lambda: span_info(alice)["unfinished"]["in_flight"] == 0)
    assert_serves(alice)


@pytest.mark.swarm
def test_a_request_beyond_the_models_positions_is_refused_before_compute(alice):
    """A sequence longer than the model's context (512 positions here) is refused on its first part with an
    error naming the limit, whether it comes as a stream or in one message; nothing is computed."""
    computed = alice.info()["rows_computed"]
    for call in (lambda: alice.stream(stream_parts(torch.randn(1, POSITIONS + 1, HIDDEN))),
                 lambda: alice.unary(one_part(torch.randn(1, 4 * POSITIONS, HIDDEN)))):
        error = refused(call)
        assert error.code == ErrorCode.TOO_LARGE
        assert f"exceed the model's context of {POSITIONS} positions" in error.message
    assert alice.info()["rows_computed"] == computed
    assert_serves(alice)


@pytest.mark.swarm
def test_a_long_pass_whose_caller_has_gone_is_cancelled(long_server):
    """A pass of 6,144 positions through 32 blocks runs far longer than the server's 2 s request timeout.
    Told ``busy`` at the timeout, or given up by its caller, it is stopped between blocks (``cancelled``
    counts it) and the compute thread serves the next request; a caller that gave up gets no answer, so
    the server counts no failure for it (it did not wait for its own timeout). A cancelled cache fill leaves
    no half-written cache behind: its reuse misses."""
    peer = Peer(long_server)
    long = one_part(torch.randn(1, 6144, HIDDEN), end=32)
    small = one_part(torch.randn(1, 8, HIDDEN), end=32)
    fill = request_parts(ForwardRequest(0, 32, torch.randn(1, 6144, HIDDEN), "filled", 0,
                                        cache=CacheDirective(1, None, 0)))[0]
    reuse = request_parts(ForwardRequest(0, 32, torch.randn(1, 8, HIDDEN), "filled", 1,
                                         cache=CacheDirective(1, (0, 8), 0)))[0]
    try:
        error = refused(lambda: peer.unary(long))
        assert error.code == ErrorCode.BUSY and "compute took over 2" in error.message
        wait_until(lambda: span_info(peer)["cancelled"] == 1, 60)
        assert peer.unary(small)[0].shape == (1, 8, HIDDEN)

        failed = peer.info()["requests_failed"]
        with pytest.raises(asyncio.TimeoutError):
            peer.run(asyncio.wait_for(peer.stub.rpc_forward(fill), 0.5))
        wait_until(lambda: span_info(peer)["cancelled"] == 2, 60)
        assert peer.info()["requests_failed"] == failed
        assert refused(lambda: peer.unary(reuse)).code == ErrorCode.CACHE_MISS
        assert peer.info()["cache"]["versions"] == 0
        assert peer.unary(small)[0].shape == (1, 8, HIDDEN)
        assert span_info(peer)["in_flight"] == 0 and long_server.alive
    finally:
        peer.close()


@pytest.mark.swarm
def test_garbage_metadata_gets_a_specific_message(alice):
    error = refused(lambda: alice.unary(runtime_pb2.ExpertRequest(uid="forward", metadata=b"\xc1\xff\x00garbage")))
    assert error.code == ErrorCode.BAD_REQUEST
    assert "FormatError: Invalid msgpack format" in error.message and "c1ff00" in error.message
    huge = runtime_pb2.ExpertRequest(uid="forward", metadata=MSGPackSerializer.dumps({"x": "y" * MAX_METADATA_BYTES}))
    assert refused(lambda: alice.unary(huge)).code == ErrorCode.TOO_LARGE
    assert_serves(alice)


@pytest.mark.parametrize("kind", ["declared shape over the limit", "more bytes than declared",
                                  "one message over the stream limit", "answer too large for unary"])
@pytest.mark.swarm
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
        error = refused(lambda: alice.unary(one_part(torch.randn(24, POSITIONS, HIDDEN))))
        assert "does not fit a unary call" in error.message
    assert error.code == ErrorCode.TOO_LARGE
    assert alice.info()["rows_computed"] == computed
    assert_serves(alice)


# ----- admission rules ---------------------------------------------------------------------------
def test_reserved_places_are_kept_for_known_peers():
    admission = Admission("requests", max_count=4, max_amount=100, peer_share=1.0, reserve=0.25)
    grants = [admission.acquire(f"new-{i}", 10) for i in range(3)]
    with pytest.raises(RemoteError, match="kept for peers that completed requests"):
        admission.acquire("new-3", 10)
    grants.append(admission.acquire("known", 10, known=True))
    with pytest.raises(RemoteError, match="4 requests in flight"):
        admission.acquire("known-2", 10, known=True)
    for grant in grants:
        grant.release()


def test_the_cost_of_a_pass_includes_attentions_length_term():
    """At the default model's widths attention costs as much as the projections at 1,024 positions, so a
    request of 1 x 1024 is counted at twice its tokens, and one of 16 x 64 at about its tokens."""
    scale = attention_length_scale(ModelFiles("default").config)
    assert scale == 1024
    assert request_cost(1, 1024, scale) == 2 * 1024
    assert request_cost(16, 64, scale) == 16 * 64 + 64
    assert request_cost(1, 4096, scale) == 5 * 4096  # four times the positions, five times the cost



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
def measure_tiny_fills_in_a_fresh_process() -> tuple[dict, dict]:
    """Both measurements (overhead counted, then tensors alone), in a fresh process: in the test process, the
    threads, servers and models of earlier tests allocate and free on their own. One thread and every Python
    object through malloc, so that ``mallinfo2`` sees it all; measured so, the same run holds the same bytes to
    within a few kB (3.27-3.28 MB over 3 runs of 3,500 fills; 1.68 MB of 1,750)."""
    code = ("import json, torch; torch.set_num_threads(1); from tests.tiny_fills import measure_tiny_fills as m; "
            "print(json.dumps([m(True), m(False)]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent,
                          env=dict(os.environ, PYTHONMALLOC="malloc", MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    counted, tensors_only = json.loads(done.stdout.strip().splitlines()[-1])
    return counted, tensors_only


@pytest.mark.swarm
@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="reads glibc's mallinfo2")
def test_tiny_cache_fills_are_counted_at_their_real_cost():
    """What the cache counts stays within its budget, and so does the memory the process really holds for the
    fills; counted at their tensors alone, the same fills hold more than the budget (so the measurement can fail).
    Held bytes, not the resident size: that moved by up to 9 MB between identical runs (6.2-15.5 MB) and failed
    a loaded CI run at 8.6 MB of an 8 MB budget while malloc held 6.4 MB."""
    counted, tensors_only = measure_tiny_fills_in_a_fresh_process()
    assert counted["held"] <= counted["budget"], (
        f"{counted['kept']} versions counted at {counted['used_bytes']} bytes hold {counted['held']} bytes")
    assert tensors_only["kept"] == FILLS and tensors_only["held"] > tensors_only["budget"]


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
