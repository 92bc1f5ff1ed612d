"""What a hostile client can make one server hold: floods of undelivered pushes and of tiny cache fills.

Starts one server of the default model (blocks 0:8) on 127.0.0.1 and attacks it from a bare libp2p peer:

1. ``--pushes`` maximum-size pushed requests (16 x 1024 tokens, 8 MiB each) whose delivery target accepts the
   stream and never reads it, two at a time (more would be refused by the compute queue's per-peer share);
2. ``--fills`` cache fills of one position each, every one under a new session id, then the latency of a
   cached reuse call;
3. one request stream of ``--stream-mb`` MiB, far over the payload limit;
4. ``--adapters`` forward requests each carrying a new rank-64 LoRA of the 8 blocks (6.9 MB), while another peer's
   LoRA, sent before the flood, should stay held (the server keeps adapter tensors by digest, ``--adapter-memory-mb``,
   one peer at most ``--peer-share`` of it);
5. ``--sybils`` bare libp2p peers (each its own peer id) that keep stalling request streams: each sends the first
   part of a request of 1 x 1024 positions (small, to take as many places as the count allows) and nothing more,
   and opens another as soon as the server answered. It prints an honest client's median latency, unloaded and
   during the attack, side by side: a unary request (one part), and a streamed one from the same client (which has
   completed requests here), and whether a new peer's streamed request gets in.

It prints the server's resident memory (its Python process; the libp2p daemon separately) before, at the
peak and after, what was accepted and refused (with the first refusal's message), and the server's own
counters. ``--baseline DIR`` runs the server from another checkout instead (e.g. the previous commit,
exported with ``git archive HEAD | tar -x -C DIR``), with the same attack, for before/after figures.

    python benchmarks/server_bounds.py
    python benchmarks/server_bounds.py --baseline /tmp/old --cache-memory-mb 64
    python benchmarks/server_bounds.py --pushes 0 --fills 0 --stream-mb 0 --adapters 100
    python benchmarks/server_bounds.py --pushes 0 --fills 0 --stream-mb 0 --adapters 0 --sybils 20
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, when run as a script

import psutil  # noqa: E402
import torch  # noqa: E402
from hivemind.p2p import P2P, PeerID  # noqa: E402

from swarm.adapters.block import BlockAdapter  # noqa: E402
from swarm.adapters.kinds import LORA  # noqa: E402
from swarm.adapters.lora import BlockWidths  # noqa: E402
from swarm.dht.node import create_p2p  # noqa: E402
from swarm.diffusion.pipeline import CacheDirective  # noqa: E402
from swarm.models.loading import ModelFiles  # noqa: E402
from swarm.testing.silent_delivery import add_silent_delivery  # noqa: E402
from swarm.utils.event_loop import BackgroundLoop  # noqa: E402
from swarm.utils.local_swarm import LocalSwarm, ManagedProcess  # noqa: E402
from swarm.wire.encoding import request_parts  # noqa: E402
from swarm.wire.messages import ForwardRequest, PushSpec, RemoteError  # noqa: E402
from swarm.wire.remote import RemoteCaller  # noqa: E402
from swarm.wire.services import SpanService  # noqa: E402

MiB = 2**20
CONFIG = ModelFiles("default").config
HIDDEN = CONFIG.hidden_size  # the default model's
MAX_TOKENS = 16384  # the server's default --max-batch-tokens


class Attacker:
    """A bare libp2p peer connected to one server, calling its RPCs as any client could."""

    def __init__(self, server: ManagedProcess):
        self.server = server
        self.loop = BackgroundLoop(name="attacker")
        self.p2p: P2P = self.loop.run(create_p2p(server.maddrs), timeout=60)
        self.caller = RemoteCaller(self.p2p)
        self.peer_id = str(self.p2p.peer_id)

    def run(self, coroutine, timeout: float = 600):
        return self.loop.run(coroutine, timeout)

    def info(self) -> dict:
        return self.run(self.caller.info(self.server.peer_id, 10))[0]

    async def silent_target(self) -> str:
        """A delivery namespace whose handler accepts each stream and never reads it."""
        return await add_silent_delivery(self.p2p, uuid.uuid4().hex)

    async def call(self, request: ForwardRequest, push: bool) -> Optional[RemoteError]:
        """None when accepted, else the error (busy, too_large, ...)."""
        try:
            if push:
                await self.caller.push(self.server.peer_id, request, 120)
            else:
                await self.caller.forward(self.server.peer_id, request, 120)
            return None
        except RemoteError as error:
            return error

    async def many(self, requests: list[ForwardRequest], push: bool, concurrency: int) -> list[Optional[RemoteError]]:
        gate = asyncio.Semaphore(concurrency)

        async def one(request: ForwardRequest) -> Optional[RemoteError]:
            async with gate:
                return await self.call(request, push)

        return await asyncio.gather(*[one(request) for request in requests])

    def stall_forever(self, request: ForwardRequest, streams: int, retry: float) -> asyncio.Future:
        """Keep ``streams`` streams stalled: send the first part of ``request``'s stream and nothing more, again
        ``retry`` seconds after the server answered (refused, or dropped at the deadline), until the returned future
        is cancelled."""
        first = request_parts(request)[0]
        stub = SpanService.get_stub(self.p2p, PeerID.from_base58(self.server.peer_id))

        async def parts():
            yield first
            await asyncio.sleep(3600)

        async def loop() -> None:
            while True:
                try:
                    responses = await stub.rpc_forward_stream(parts())
                    await anext(responses)  # the server's answer; then the stream is cut
                    await responses.aclose()
                except Exception:
                    pass
                await asyncio.sleep(retry)

        async def loops() -> None:
            await asyncio.gather(*[loop() for _ in range(streams)])

        return asyncio.run_coroutine_threadsafe(loops(), self.loop.loop)

    def close(self) -> None:
        self.run(self.p2p.shutdown(), timeout=30)
        self.loop.stop()


class Memory:
    """Resident memory of the server's Python process and of its child processes (the libp2p daemon)."""

    def __init__(self, pid: int):
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def now(self) -> tuple[int, int]:
        children = sum(child.memory_info().rss for child in self.process.children(recursive=True))
        return self.process.memory_info().rss, children

    def __enter__(self) -> "Memory":
        self.peak = self.now()[0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.now()[0])

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def mb(value: int) -> str:
    return f"{value / MiB:.0f} MiB"


def refusals(results: list[Optional[RemoteError]]) -> str:
    refused = [r for r in results if r is not None]
    codes = sorted({r.code.value for r in refused})
    first = f"; first: {refused[0].message}" if refused else ""
    return f"{len(results) - len(refused)} accepted, {len(refused)} refused ({', '.join(codes) or '-'}){first}"


def flood_pushes(attacker: Attacker, memory: Memory, count: int, settle: float) -> None:
    namespace = attacker.run(attacker.silent_target())
    hidden = torch.randn(16, MAX_TOKENS // 16, HIDDEN)  # 16 rows of 1024: attention stays cheap
    requests = [ForwardRequest(0, 8, hidden, f"push-{i}", 0,
                               push=PushSpec((), attacker.peer_id, namespace, f"push-{i}", (0.0, 0.0)))
                for i in range(count)]
    before = memory.now()
    started = time.perf_counter()
    with memory:
        results = attacker.run(attacker.many(requests, push=True, concurrency=2))
        time.sleep(1.5)  # compute is idle: its freed memory is given back
        pending, held = attacker.info()["push"].get("pending", {}).get("in_flight", "?"), memory.now()[0]
        time.sleep(settle)  # the deliveries time out (or not) meanwhile
    after = memory.now()
    print(f"pushes: {count} x {mb(hidden.numel() * 4)} to a target that never reads, "
          f"{time.perf_counter() - started:.0f} s")
    print(f"  server RSS {mb(before[0])} -> peak {mb(memory.peak)} -> {mb(held)} with {pending} pending -> "
          f"{mb(after[0])} {settle:.0f} s later; daemon {mb(before[1])} -> {mb(after[1])}")
    print(f"  {refusals(results)}")
    print(f"  server: {attacker.info()['push']}")


def flood_fills(attacker: Attacker, memory: Memory, count: int) -> None:
    def fill(session: str) -> ForwardRequest:
        return ForwardRequest(0, 8, torch.randn(1, 1, HIDDEN), session, 0, cache=CacheDirective(1, None, 0))

    def reuse_ms(session: str, repeats: int = 100, warmup: int = 20) -> float:
        request = ForwardRequest(0, 8, torch.randn(1, 1, HIDDEN), session, 1, cache=CacheDirective(1, (0, 1), 0))
        times = []
        for _ in range(warmup):
            attacker.run(attacker.call(request, push=False))
        for _ in range(repeats):
            started = time.perf_counter()
            error = attacker.run(attacker.call(request, push=False))
            assert error is None, error
            times.append(1000 * (time.perf_counter() - started))
        return statistics.median(times)

    attacker.run(attacker.call(fill("first"), push=False))
    few = reuse_ms("first")
    before = memory.now()
    started = time.perf_counter()
    with memory:
        results = attacker.run(attacker.many([fill(f"s{i:06d}") for i in range(count)], push=False, concurrency=8))
    after = memory.now()
    many = reuse_ms(f"s{count - 1:06d}")
    cache = attacker.info()["cache"]
    print(f"cache fills: {count} sessions of 1 position x 8 blocks, {time.perf_counter() - started:.0f} s")
    print(f"  server RSS {mb(before[0])} -> peak {mb(memory.peak)} -> {mb(after[0])}; counted "
          f"{mb(cache['used_bytes'])} of {mb(cache['budget_bytes'])} in {cache['versions']} versions "
          f"(limit {cache.get('max_versions', '-')}), {cache['evictions']} evicted")
    print(f"  {refusals(results)}")
    print(f"  a cached reuse call: {few:.1f} ms with 2 versions kept, {many:.1f} ms with {cache['versions']} (median)")


def oversized_stream(attacker: Attacker, memory: Memory, size_mb: int) -> None:
    tokens = size_mb * MiB // (4 * HIDDEN)
    request = ForwardRequest(0, 8, torch.randn(1, tokens, HIDDEN), "big", 0)
    before = memory.now()
    computed = attacker.info()["rows_computed"]
    started = time.perf_counter()
    with memory:
        error = attacker.run(attacker.call(request, push=False))
    print(f"one stream of {size_mb} MiB (1 x {tokens} x {HIDDEN}): answered in {time.perf_counter() - started:.1f} s "
          f"with {error}")
    print(f"  server RSS {mb(before[0])} -> peak {mb(memory.peak)}; rows computed "
          f"{attacker.info()['rows_computed'] - computed}")


def flood_adapters(attacker: Attacker, honest: Attacker, memory: Memory, count: int) -> None:
    rows = BlockWidths.of(CONFIG).rows(64)

    def with_lora(seed: int) -> ForwardRequest:
        weights = torch.randn(8, rows, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 1e-3
        return ForwardRequest(0, 8, torch.randn(1, 4, HIDDEN), adapter=BlockAdapter(LORA, weights))

    kept = with_lora(-1)
    assert honest.run(honest.call(kept, push=False)) is None
    before = memory.now()
    started = time.perf_counter()
    with memory:
        results = [attacker.run(attacker.call(with_lora(i), push=False)) for i in range(count)]
    after = memory.now()
    named = honest.run(honest.call(kept, push=False))  # named by digest: held unless the flood evicted it
    store = attacker.info()["adapter_tensors"]
    print(f"adapter tensors: {count} LoRAs of rank 64 x 8 blocks ({mb(kept.prompts.numel() * 4)} each) from one peer, "
          f"{time.perf_counter() - started:.0f} s")
    print(f"  server RSS {mb(before[0])} -> peak {mb(memory.peak)} -> {mb(after[0])}; counted {mb(store['bytes'])} of "
          f"{mb(store['max_bytes'])} in {store['entries']} entries, {store['evictions']} evicted, "
          f"{store['refused']} not kept")
    print(f"  {refusals(results)}")
    print(f"  another peer's LoRA sent before the flood, named after it: "
          f"{'still held' if named is None and honest.caller.adapter_misses == 0 else f'sent again ({named})'}")


def median_ms(attacker: Attacker, request: ForwardRequest, calls: int) -> tuple[float, int]:
    """The median latency of the calls that succeeded, and how many did."""
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        if attacker.run(attacker.call(request, push=False)) is None:
            times.append(1000 * (time.perf_counter() - started))
    return (statistics.median(times) if times else float("nan")), len(times)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process and its children (the libp2p daemons) so far."""
    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(sum(process.cpu_times()[:2]) for process in processes)


def held_places(span: dict) -> int:
    """Places the stalled streams hold: among the unfinished streams (a server of a checkout before them: in the
    compute queue)."""
    return span["unfinished"]["in_flight"] if "unfinished" in span else span["in_flight"]


def run_sybils(maddrs: list[str], peer_id: str, count: int, streams: int, retry: float, ready, stop) -> None:
    """In a process of its own (the sybils' client side must not share the honest client's interpreter): ``count``
    peer ids each keeping ``streams`` streams stalled, until ``stop`` is set."""
    server = SimpleNamespace(maddrs=maddrs, peer_id=peer_id)
    stalled = ForwardRequest(0, 8, torch.randn(1, 1024, HIDDEN))  # small: as many places as the count allows
    sybils = [Attacker(server) for _ in range(count)]
    loops = [sybil.stall_forever(stalled, streams, retry) for sybil in sybils]
    ready.set()
    stop.wait()
    for future in loops:
        future.cancel()
    for sybil in sybils:
        sybil.close()


def stalling_sybils(server: ManagedProcess, honest: Attacker, count: int, calls: int, streams: int,
                    retry: float) -> None:
    unary = ForwardRequest(0, 8, torch.randn(1, 256, HIDDEN))  # one part: a unary call
    streamed = ForwardRequest(0, 8, torch.randn(4, 1024, HIDDEN))  # 3 MiB: a stream of several parts
    assert len(request_parts(unary)) == 1 and len(request_parts(streamed)) > 1
    median_ms(honest, unary, 3)  # warm up; the client completes requests here (a known peer)
    before = {name: median_ms(honest, request, calls) for name, request in (("unary", unary), ("stream", streamed))}
    started = time.perf_counter()
    spawn = multiprocessing.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    attack = spawn.Process(target=run_sybils, args=(server.maddrs, server.peer_id, count, streams, retry, ready, stop))
    attack.start()
    newcomer = Attacker(server)
    try:
        assert ready.wait(300), "the sybils did not start"
        time.sleep(3)  # the sybils' streams take every place they may
        held = held_places(honest.info()["admission"]["span"])
        cpu = (time.perf_counter(), cpu_seconds(server.process.pid), cpu_seconds(attack.pid))
        during = {name: median_ms(honest, request, calls) for name, request in (("unary", unary), ("stream", streamed))}
        seconds = time.perf_counter() - cpu[0]
        server_cpu, sybils_cpu = cpu_seconds(server.process.pid) - cpu[1], cpu_seconds(attack.pid) - cpu[2]
        new_stream = median_ms(newcomer, streamed, 5)
        info = honest.info()["admission"]["span"]
    finally:
        stop.set()
        attack.join(120)
        newcomer.close()
    print(f"stalling sybils: {count} peer ids each keep {streams} streams of 1 x 1024 positions stalled after their "
          f"first part (another {retry} s after each answer), "
          f"{time.perf_counter() - started:.0f} s; {held} places held by stalled streams when measured")
    for name in ("unary", "stream"):
        (alone, ok_alone), (attacked, ok_attacked) = before[name], during[name]
        print(f"  honest {name} call: {alone:.1f} ms unloaded, {attacked:.1f} ms with the sybils "
              f"(x{attacked / alone:.2f}); {ok_alone}/{calls} and {ok_attacked}/{calls} served")
    print(f"  a new peer's stream call during the attack: {new_stream[1]}/5 served")
    print(f"  CPU while the honest calls were timed under attack ({seconds:.0f} s): server and its daemon "
          f"{100 * server_cpu / seconds:.0f}% of a core, the sybils' process and daemons "
          f"{100 * sybils_cpu / seconds:.0f}%")
    unfinished = info.get("unfinished", {})
    print(f"  server: unfinished streams {unfinished.get('refused', '-')} refused, {unfinished.get('dropped', '-')} "
          f"dropped at their deadline; compute queue {info['refused']} refused; {info.get('known', '-')} known peers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pushes", type=int, default=47, help="maximum-size pushes to a target that never reads")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds to wait after the pushes")
    parser.add_argument("--fills", type=int, default=14000, help="one-position cache fills, each a new session")
    parser.add_argument("--stream-mb", type=int, default=100, help="size of the oversized request stream")
    parser.add_argument("--cache-memory-mb", type=float, default=64.0, help="the server's --cache-memory-mb")
    parser.add_argument("--adapters", type=int, default=100, help="forward requests each with a new LoRA tensor")
    parser.add_argument("--adapter-memory-mb", type=float, default=64.0, help="the server's --adapter-memory-mb")
    parser.add_argument("--sybils", type=int, default=20, help="peer ids stalling request streams")
    parser.add_argument("--stalls-per-sybil", type=int, default=2, help="streams each sybil keeps stalled at once")
    parser.add_argument("--sybil-retry", type=float, default=1.0,
                        help="seconds a sybil waits after an answer before it stalls another stream")
    parser.add_argument("--honest-calls", type=int, default=20, help="honest calls timed, unloaded and attacked")
    parser.add_argument("--baseline", default=None, help="run the server from this checkout instead")
    args = parser.parse_args()

    entry = ("-m", "swarm.server")
    if args.baseline:  # `python -c` puts the working directory first on the path: put the checkout before it
        entry = ("-c", f"import sys, runpy; sys.path.insert(0, {args.baseline!r}); "
                       "runpy.run_module('swarm.server', run_name='__main__')")
    with LocalSwarm() as swarm:
        adapter_memory = ("--adapter-memory-mb", str(args.adapter_memory_mb)) if args.adapters else ()
        server = swarm.start_server("default", "0:8", "--compute-threads", "1", "--cache-memory-mb",
                                    str(args.cache_memory_mb), *adapter_memory, entry=entry)
        memory = Memory(server.process.pid)
        attacker = Attacker(server)
        honest = Attacker(server) if args.adapters else None
        try:
            print(f"server {'from ' + args.baseline if args.baseline else 'of this checkout'}, "
                  f"RSS {mb(memory.now()[0])} at start")
            if args.pushes:
                flood_pushes(attacker, memory, args.pushes, args.settle)
            if args.fills:
                flood_fills(attacker, memory, args.fills)
            if args.stream_mb:
                oversized_stream(attacker, memory, args.stream_mb)
            if args.adapters:
                flood_adapters(attacker, honest, memory, args.adapters)
            if args.sybils:
                stalling_sybils(server, attacker, args.sybils, args.honest_calls, args.stalls_per_sybil,
                                args.sybil_retry)
            print(f"server alive: {server.alive}")
        finally:
            attacker.close()
            if honest is not None:
                honest.close()


if __name__ == "__main__":
    main()
