"""Batching several callers' passes into one on the compute thread (issue 47 item 3, swarm/server/backend.py), in
process: no socket, no clock. The compute thread is held by a pass that waits on an event until every request under
test is queued, so what gets merged is decided by the queue's contents, never by timing."""
from __future__ import annotations

import asyncio
import threading

import torch

from swarm.diffusion.prediction import HeadQuery
from swarm.models.kv_cache import SpanKV
from swarm.models.modules import BlockSpan, OutputHead
from swarm.server.backend import SpanBackend, SpanCall, batch_key
from swarm.server.scheduler import FairScheduler
from swarm.testing.checkpoints import tiny_config

CONFIG = tiny_config()


def backend(batching: bool = True, max_batch_tokens: int = 16384) -> SpanBackend:
    torch.manual_seed(0)
    span = BlockSpan(CONFIG, 0, CONFIG.num_layers)
    head = OutputHead(CONFIG)
    for module in (span, head):
        for parameter in module.parameters():
            torch.nn.init.normal_(parameter, std=0.2)
    return SpanBackend(span, max_concurrent=64, max_queued_tokens=10**7, head=head, batching=batching,
                       max_batch_tokens=max_batch_tokens, scheduler=FairScheduler())


def head_query(length: int, seed: int) -> HeadQuery:
    return HeadQuery(block_starts=(length - 8,), block_length=8, steps=(1,), seed=seed, temperature=0.5,
                     cfg_scale=0.0, mask_token_id=CONFIG.mask_token_id, scored=(length - 8, length))


def run_while_held(server: SpanBackend, calls: list[tuple[str, SpanCall]]) -> list:
    """Every call queued behind a pass that holds the compute thread, then the thread let go: answers in order."""
    async def main():
        release, holding = threading.Event(), threading.Event()

        def hold():
            holding.set()
            release.wait(60)

        blocker = asyncio.ensure_future(server.queue.run(1, hold, peer="blocker"))
        await asyncio.get_running_loop().run_in_executor(None, holding.wait, 60)
        tasks = [asyncio.ensure_future(server.forward(call, peer=peer)) for peer, call in calls]
        await asyncio.sleep(0)  # every forward has queued its pass (each queues before its first await)
        assert len(server.queue.scheduler) == len(calls)
        release.set()
        await blocker
        return await asyncio.gather(*tasks)

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
        return await asyncio.gather(gone, return_exceptions=True)

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
