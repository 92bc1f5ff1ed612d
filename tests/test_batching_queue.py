"""Batching several callers' passes into one on the compute thread (issue 47 item 3, swarm/server/backend.py), and long
passes run in pieces between blocks so that a small call never waits for a whole long one (issue 55 class 6), in
process: no socket, no clock. The compute thread is held by a pass that waits on an event until every request under
test is queued, so what gets merged, and in which order pieces run, is decided by the queue's contents, never by
timing."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Optional

import torch

from swarm.diffusion.prediction import HeadQuery
from swarm.models.kv_cache import SpanKV
from swarm.models.modules import BlockSpan, OutputHead
from swarm.server.backend import SpanBackend, SpanCall, batch_key, piece_bounds
from swarm.server.scheduler import FairScheduler
from swarm.testing.checkpoints import tiny_config

CONFIG = tiny_config()


def backend(batching: bool = True, max_batch_tokens: int = 16384, max_piece_tokens: int = 16384) -> SpanBackend:
    torch.manual_seed(0)
    span = BlockSpan(CONFIG, 0, CONFIG.num_layers)
    head = OutputHead(CONFIG)
    for module in (span, head):
        for parameter in module.parameters():
            torch.nn.init.normal_(parameter, std=0.2)
    return SpanBackend(span, max_concurrent=64, max_queued_tokens=10**7, head=head, batching=batching,
                       max_batch_tokens=max_batch_tokens, scheduler=FairScheduler(),
                       max_piece_tokens=max_piece_tokens)


def head_query(length: int, seed: int) -> HeadQuery:
    return HeadQuery(block_starts=(length - 8,), block_length=8, steps=(1,), seed=seed, temperature=0.5,
                     cfg_scale=0.0, mask_token_id=CONFIG.mask_token_id, scored=(length - 8, length))


async def settled(server: SpanBackend, timeout: float = 30.0) -> None:
    """Wait until the compute thread's hand-back has run on this loop. It comes one loop turn after the last answer
    (``ComputeQueue._thread_free``, then ``_hand_on``): a test that let ``asyncio.run`` close its loop first left the
    queue marked running for good, and its next pass on the same server waited forever behind nothing (seen as a
    blocker still waiting, 2026-12-06). A server's loop lives as long as the server: only tests that run one loop per
    call need this."""
    deadline = time.monotonic() + timeout
    while server.queue.running:
        assert time.monotonic() < deadline, f"the compute thread was never handed back: {waiting(server)}"
        await asyncio.sleep(0.001)


def waiting(server: SpanBackend) -> dict:
    """Per flow, the (caller, resumed, dropped) of each pass the server's scheduler holds: what a failed premise
    shows."""
    return {name: [(job.peer, job.resumed, job.dropped()) for job in [*flow.jobs, *(job for queue in
                   flow.members.values() for job in queue)]] for name, flow in server.queue.scheduler.flows.items()}


def run_while_held(server: SpanBackend, calls: list[tuple[str, SpanCall]], finished: Optional[list] = None,
                   proved: bool = False) -> list:
    """Every call queued behind a pass that holds the compute thread, then the thread let go: answers in order
    (and the callers in the order they were answered, into ``finished``). With ``proved`` each call proves its cost
    (as a work stamp would): each caller is a flow of its own."""
    async def main():
        release, holding = threading.Event(), threading.Event()

        def hold():
            holding.set()
            release.wait(60)

        blocker = asyncio.ensure_future(server.queue.run(1, hold, peer="blocker"))
        assert await asyncio.get_running_loop().run_in_executor(None, holding.wait, 60), waiting(server)
        tasks = [asyncio.ensure_future(server.forward(call, peer=peer, proved=proved * server.cost(
            *call.hidden.shape[:2]))) for peer, call in calls]
        for (peer, _), task in zip(calls, tasks):
            task.add_done_callback(lambda _, peer=peer: finished.append(peer) if finished is not None else None)
        await asyncio.sleep(0)  # every forward has queued its pass (each queues before its first await)
        assert len(server.queue.scheduler) == len(calls), waiting(server)  # failed once in a loaded full run
        release.set()
        await blocker
        answers = await asyncio.gather(*tasks)
        await settled(server)
        return answers

    return asyncio.run(main())


def solo(server: SpanBackend, call: SpanCall) -> torch.Tensor:
    return server.forward_sync(call)


def test_waiting_passes_of_one_length_are_merged_and_each_answer_is_its_solo_pass():
    server = backend()
    generator = torch.Generator().manual_seed(1)
    calls = [(f"client-{index}", SpanCall(torch.randn(batch, 24, CONFIG.hidden_size, generator=generator), 0,
                                          CONFIG.num_layers, head=head_query(24, index) if index % 2 else None))
             for index, batch in enumerate((1, 2, 1, 3, 1, 2))]
    answers = run_while_held(server, calls)
    # client-0's turn: the 1-row calls join it (0, 2, 4); client-1's: the 2-row one (1, 5); client-3 (3 rows) alone
    assert server.queue.batches == 2 and server.queue.batched == 5
    for (_, call), answer in zip(calls, answers):
        assert torch.equal(answer, solo(server, call))  # bitwise: float32 rows do not depend on their batch-mates
    assert server.queue.in_flight == 0 and len(server.queue.scheduler) == 0


def test_other_lengths_cached_or_adapted_passes_and_batching_off_run_alone():
    server = backend()
    hidden = torch.randn(1, 16, CONFIG.hidden_size)
    kv = SpanKV(1, 16)
    calls = [("a", SpanCall(hidden, 0, CONFIG.num_layers)), ("b", SpanCall(torch.randn(1, 20, CONFIG.hidden_size), 0,
                                                                           CONFIG.num_layers)),
             ("c", SpanCall(hidden, 0, CONFIG.num_layers, kv=kv)), ("d", SpanCall(hidden, 0, 2))]
    assert batch_key(calls[2][1]) is None
    answers = run_while_held(server, calls)
    assert server.queue.batches == 0
    for (_, call), answer in zip(calls[:2] + calls[3:], answers[:2] + answers[3:]):
        assert torch.equal(answer, solo(server, SpanCall(call.hidden, call.start, call.end)))
    off = backend(batching=False)
    run_while_held(off, [(peer, SpanCall(hidden, 0, CONFIG.num_layers)) for peer in "xyz"])
    assert off.queue.batches == 0


def test_a_huge_pass_is_not_merged_and_a_merged_pass_stays_within_the_bound():
    """A merged pass holds at most --max-batch-tokens positions, and no batch-mate larger than the request whose
    turn it is: a huge request runs alone, so it neither grows the batch's memory nor holds the small ones back in a
    pass of its size."""
    server = backend(max_batch_tokens=48)
    calls = [("small-1", SpanCall(torch.randn(1, 16, CONFIG.hidden_size), 0, CONFIG.num_layers)),
             ("huge", SpanCall(torch.randn(8, 16, CONFIG.hidden_size), 0, CONFIG.num_layers)),
             ("small-2", SpanCall(torch.randn(1, 16, CONFIG.hidden_size), 0, CONFIG.num_layers)),
             ("small-3", SpanCall(torch.randn(1, 16, CONFIG.hidden_size), 0, CONFIG.num_layers)),
             ("small-4", SpanCall(torch.randn(1, 16, CONFIG.hidden_size), 0, CONFIG.num_layers))]
    answers = run_while_held(server, calls)
    # small-1's turn: two more fit its 48 positions (small-2, small-3); the huge one alone; small-4 alone
    assert server.queue.batches == 1 and server.queue.batched == 3
    for (_, call), answer in zip(calls, answers):
        assert torch.equal(answer, solo(server, call))


def test_a_caller_that_stopped_waiting_before_its_pass_started_is_never_computed():
    server = backend()
    ran = []

    async def main():
        release, holding = threading.Event(), threading.Event()

        def hold():
            holding.set()
            release.wait(60)

        blocker = asyncio.ensure_future(server.queue.run(1, hold, peer="blocker"))
        await asyncio.get_running_loop().run_in_executor(None, holding.wait, 60)
        gone = asyncio.ensure_future(server.queue.run(1, ran.append, "gone", peer="gone"))
        kept = asyncio.ensure_future(server.queue.run(1, ran.append, "kept", peer="kept"))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        release.set()
        await blocker
        await kept
        outcome = await asyncio.gather(gone, return_exceptions=True)
        await settled(server)
        return outcome

    outcome = asyncio.run(main())
    assert isinstance(outcome[0], asyncio.CancelledError) and ran == ["kept"]
    assert server.queue.in_flight == 0 and server.queue.abandoned == 1


def test_servers_batch_by_default_where_the_passes_are_batch_invariant():
    """A merged row is bitwise its solo pass once the passes are batch-invariant (swarm.models.invariance), so
    servers batch by default: where the check on their device fails they do not (swarm/server/server.py), and
    --no-batching is the operator's way out."""
    from swarm.server.config import ServerConfig

    assert ServerConfig().batching is True and ServerConfig().batch_invariant is True
    assert backend(batching=False).queue.merge is None and backend().queue.merge is not None


def test_a_long_pass_runs_in_pieces_between_blocks_and_small_calls_go_between_them():
    """Issue 55 class 6: three callers' 64-position passes held a small caller's call for their whole length (the
    queue never preempted). Now a pass of more than --max-piece-tokens positions x blocks runs piece by piece, back
    to the fair order after each: the small calls, waiting behind it, are answered after one piece, not after the
    three long passes, and every answer is its one-pass answer to the bit."""
    server = backend(batching=False, max_piece_tokens=64)
    generator = torch.Generator().manual_seed(2)
    big = [(f"big-{index}", SpanCall(torch.randn(4, 16, CONFIG.hidden_size, generator=generator), 0,
                                     CONFIG.num_layers)) for index in (1, 2, 3)]
    small = [("small", SpanCall(torch.randn(1, 16, CONFIG.hidden_size, generator=generator), 0, CONFIG.num_layers))]
    assert server.pieces_of(big[0][1]) == CONFIG.num_layers and server.pieces_of(small[0][1]) == 1
    finished: list[str] = []
    answers = run_while_held(server, big + small, finished, proved=True)  # each caller a flow of its own
    assert finished[0] == "small"  # after big-1's first piece: before any long pass ends
    assert server.queue.info()["scheduler"]["pieces"] == 3 * (CONFIG.num_layers - 1)
    for (_, call), answer in zip(big + small, answers):
        assert torch.equal(answer, server.forward_sync(call))
    assert server.queue.in_flight == 0 and len(server.queue.scheduler) == 0


def test_merged_cached_and_adapted_passes_in_pieces_answer_what_one_pass_does():
    """Pieces are numerically neutral for every kind of forward call: merged, a cache fill and a reuse of it, an
    adapter's per-block slices, a head query at the end."""
    from swarm.adapters.block import BlockAdapter

    server = backend(max_piece_tokens=16)  # one block per piece for every call below
    generator = torch.Generator().manual_seed(3)
    merged = [(f"client-{index}", SpanCall(torch.randn(1, 16, CONFIG.hidden_size, generator=generator), 0,
                                           CONFIG.num_layers, head=head_query(16, index) if index else None))
              for index in range(3)]
    answers = run_while_held(server, merged)
    assert server.queue.batches == 1 and server.queue.info()["scheduler"]["pieces"] == CONFIG.num_layers - 1
    for (_, call), answer in zip(merged, answers):
        assert torch.equal(answer, server.forward_sync(call))
    hidden = torch.randn(1, 16, CONFIG.hidden_size, generator=generator)
    adapter = BlockAdapter("deep_prompt", torch.randn(CONFIG.num_layers, 2, CONFIG.hidden_size, generator=generator))
    fill, solo_fill = SpanKV(1, 16), SpanKV(1, 16)
    calls = [SpanCall(hidden, 0, CONFIG.num_layers, adapter=adapter), SpanCall(hidden, 0, CONFIG.num_layers, fill)]
    pieced = run_while_held(server, [("a", call) for call in calls])
    assert torch.equal(pieced[0], server.forward_sync(calls[0]))
    assert torch.equal(pieced[1], server.forward_sync(SpanCall(hidden, 0, CONFIG.num_layers, solo_fill)))
    fresh = torch.randn(1, 4, CONFIG.hidden_size, generator=generator)
    server = backend(max_piece_tokens=4)  # the same weights; one block per piece for a reuse of 4 rows too
    query = HeadQuery((4,), 4, (0,), seed=9, temperature=0.5, cfg_scale=0.0, mask_token_id=CONFIG.mask_token_id,
                      scored=(4, 8))
    reuse = run_while_held(server, [("a", SpanCall(fresh, 0, CONFIG.num_layers, fill, (4, 8), query))])
    assert server.pieces_of(SpanCall(fresh, 0, CONFIG.num_layers)) == CONFIG.num_layers > 1
    assert torch.equal(reuse[0], server.forward_sync(SpanCall(fresh, 0, CONFIG.num_layers, solo_fill, (4, 8), query)))


def test_a_pass_whose_caller_left_between_pieces_stops_and_frees_its_place():
    server = backend(batching=False, max_piece_tokens=16)
    call = SpanCall(torch.randn(1, 16, CONFIG.hidden_size), 0, CONFIG.num_layers)

    async def main():
        task = asyncio.ensure_future(server.forward(call, peer="gone"))
        while server.queue.pieces == 0 and not task.done():  # its first piece has run: the rest waits its turn
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        while server.queue.in_flight:
            await asyncio.sleep(0.001)

    asyncio.run(main())
    assert server.queue.cancelled == 1 and server.queue.pieces < CONFIG.num_layers - 1


def test_pieces_cover_the_blocks_in_order_within_the_bound():
    assert piece_bounds(0, 8, 100, 400) == [(0, 4), (4, 8)]
    assert piece_bounds(3, 8, 5000, 400) == [(3, 4), (4, 5), (5, 6), (6, 7), (7, 8)]  # one block at least
    assert piece_bounds(2, 5, 1, 16384) == [(2, 5)]
