"""One server under several callers: batching across clients (issue 47) and fair shares (issue 48), side by side.

* ``concurrency``: 1, 4 and 16 concurrent clients of one server holding every block (and the head): aggregate
  tokens/s and its ratio to one client, with the server batching and without, every client's tokens checked
  against its solo run (the local model's, which a solo run through the swarm equals), and how busy the server's
  compute thread was (its seconds over the wall time: below 100% the clients, not the server, were the limit).
* ``shares``: the red team's shapes. (a) A heavy user generating while a stranger sends a 1-position call every few
  seconds to a server started with ``--max-share-per-caller 0.5 --share-window 60``: the heavy user's time with and
  without the stranger (the refusing cap made it 179.5 s instead of 0.04 s). (b) A long-standing user against a
  stranger sending each pass from a fresh id, several at once, on the real compute queue of the model (in process):
  the share of compute each side gets in arrival order (no scheduler), fair by id, and fair with the newcomers'
  flow (this project's scheduler).
* ``fairness``: issue 55 class 6, before and after, on the real compute queue (in process). (a) A user against k ids
  made in advance (4, 16): the shares fair by id (before), with the user's passes proving work (after), and with
  every pass proving work (what the attacker's shares then cost it in cores of minting). (b) A new client while an
  attacker keeps 100 fresh ids queued: its passes without and with stamps. (c) A small caller's median time per
  call beside three callers of 200 x 64-position passes: long passes whole (before) and in pieces (after), with
  batching off and on.

torch and the swarm are imported in the commands' bodies, so that ``--help`` answers at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import click

from swarm.cli.options import gen_length_option
from swarm.utils.local_swarm import LocalSwarm
from swarm.utils.threads import apply_threads

GREEDY = dict(gen_length=32, steps=32, block_length=32, temperature=0.0)


def prompts(count: int) -> list[list[int]]:
    """``count`` distinct prompts of one length (4 tokens): calls of equal length are what a server merges."""
    return [[10 + index, 300 + 7 * index, 900 + 3 * index, 2000 + index] for index in range(count)]


@contextlib.contextmanager
def one_server(model: str, threads: int, *extra: str) -> Iterator[tuple[LocalSwarm, str]]:
    """A bootstrap peer and one server of every block of ``model`` with the head; yields the swarm and its id."""
    from swarm.models.loading import ModelFiles

    blocks = f"0:{ModelFiles(model).config.num_layers}"
    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        server = swarm.start_server(model, blocks, "--head", "--compute-threads", str(threads), *extra)
        yield swarm, server.peer_id


def span_info(lm, peer_id: str) -> dict:
    info, _ = lm.loop.run(lm.caller.info(peer_id, 30))
    return info


@click.command()
@click.option("--model", default="default", show_default=True, help="Embedded model name or checkpoint directory.")
@click.option("--clients", default="1,4,16", show_default=True, help="Comma-separated counts of concurrent clients.")
@click.option("--threads", type=int, default=1, show_default=True, help="torch threads of the server.")
@click.option("--draft-steps", type=int, default=None,
              help="Each client's draft_steps (default: the client's own choice, 3 through a swarm at scale auto: "
                   "each call then carries up to 4 states; 0 sends one state per call).")
@gen_length_option(type=click.IntRange(1, 512), default=GREEDY["gen_length"], show_default=True,
                   help="Tokens each client generates, one per step in one block (fewer for a checkpoint of 8B widths "
                        "on a CPU, where a pass takes about a second).")
@click.option("--capacity-passes", type=click.IntRange(0), default=64, show_default=True,
              help="Passes of the in-process table of the server alone (0 leaves it out).")
def concurrency(model: str, clients: str, threads: int, draft_steps: int | None, gen_length: int,
                capacity_passes: int) -> None:
    """Aggregate tokens/s of 1, 4, 16 concurrent clients on one server, batched vs unbatched, same tokens checked."""
    from swarm.benchmark.shared_parts import SharedClientParts
    from swarm.client.config import ClientConfig, client_network
    from swarm.client.model import DistributedDiffusionLM
    from swarm.frontend.local import DiffusionLM

    counts = sorted({int(text) for text in clients.split(",") if text.strip()})
    if not counts or counts[0] < 1:
        raise click.BadParameter("give client counts of at least 1", param_hint="--clients")
    apply_threads(threads)
    asked = prompts(max(counts))
    local = DiffusionLM.from_pretrained(model)
    greedy = dict(GREEDY, gen_length=gen_length, steps=gen_length, block_length=gen_length)
    settings = {**greedy, **({} if draft_steps is None else {"draft_steps": draft_steps})}
    solo = [local.generate(prompt, **greedy).token_ids for prompt in asked]  # drafts are exact: the same tokens
    del local  # its memory for the server and the clients (3 GB at 8B widths)
    click.echo(f"model {model}, one server of every block with --head, {threads} thread(s); each client: greedy, "
               f"{gen_length} tokens in {gen_length} steps, a prompt of 4 tokens of its own, "
               f"draft_steps {'auto' if draft_steps is None else draft_steps}; the clients run in this process and "
               f"share one embedding and head")
    click.echo(f"{'server':<10}{'clients':>8}{'wall s':>9}{'tokens/s':>10}{'vs 1':>7}{'merged passes':>15}"
               f"{'requests in them':>18}{'server busy':>13}  same tokens as solo")
    rates: dict[tuple[str, int], float] = {}
    parts = SharedClientParts(model)  # one embedding and head for every client of both servers: 2 GB at 8B widths
    for mode, flag in (("unbatched", "--no-batching"), ("batched", "--batching")):
        with one_server(model, threads, flag) as (swarm, server_id):
            lms = [DistributedDiffusionLM(parts, ClientConfig(network=client_network(swarm.initial_peers)))
                   for _ in range(max(counts))]
            try:
                # connected, challenged and warm before timing, one after another: 16 compute challenges at once
                # queue for longer than a challenge may take at 8B widths on a CPU, and the clients would avoid
                # the server (a burst of clients joining a slow server at once meets the same)
                for lm in lms:
                    lm.generate(asked[0], gen_length=8, steps=2, block_length=8)
                for count in counts:
                    before = span_info(lms[0], server_id)
                    barrier = threading.Barrier(count)

                    def run(index: int) -> list[int]:
                        barrier.wait()
                        return lms[index].generate(asked[index], **settings).token_ids

                    started = time.perf_counter()
                    with ThreadPoolExecutor(count) as pool:
                        tokens = list(pool.map(run, range(count)))
                    wall = time.perf_counter() - started
                    after = span_info(lms[0], server_id)
                    busy = (after["usage"]["total"]["seconds"] - before["usage"]["total"]["seconds"]) / wall
                    before, after = (info["admission"]["span"]["scheduler"] for info in (before, after))
                    rate = count * gen_length / wall
                    rates[mode, count] = rate
                    same = all(tokens[index] == solo[index] for index in range(count))
                    click.echo(f"{mode:<10}{count:>8}{wall:>9.2f}{rate:>10.1f}{rate / rates[mode, counts[0]]:>6.2f}x"
                               f"{after['batches'] - before['batches']:>15}"
                               f"{after['batched_requests'] - before['batched_requests']:>18}{busy:>13.0%}  {same}")
            finally:
                for lm in lms:
                    lm.shutdown()
    for count in counts:
        click.echo(f"{count} client(s): batched / unbatched aggregate tokens/s "
                   f"{rates['batched', count] / rates['unbatched', count]:.2f}x")
    if capacity_passes:
        server_capacity(model, counts, length=4 + gen_length, passes=capacity_passes)


def server_capacity(model: str, counts: list[int], states: int = 4, length: int = 36, passes: int = 64) -> None:
    """The server's side alone, in process (no clients, no network): callers that each keep one pass of a client's
    call shape waiting, through the real compute queue of every block; passes per second batched vs unbatched."""
    import torch

    from swarm.models.loading import ModelFiles
    from swarm.server.backend import SpanBackend, SpanCall

    files = ModelFiles(model)
    span = files.span(0, files.config.num_layers)
    hidden = torch.randn(states, length, files.config.hidden_size)
    click.echo(f"\nthe server alone (in process): callers each keeping one pass of {states} x {length} positions "
               f"waiting, {passes} passes")
    click.echo(f"{'callers':>8}{'unbatched passes/s':>20}{'batched passes/s':>18}{'batched / unbatched':>21}")
    for count in counts:
        rates = []
        for batching in (False, True):
            backend = SpanBackend(span, max_concurrent=count + 1, max_queued_tokens=10**9, batching=batching)
            call = lambda: SpanCall(hidden, 0, files.config.num_layers)  # noqa: E731
            started = time.perf_counter()
            served = asyncio.run(closed_loops(backend, call, count, passes))
            rates.append(served / (time.perf_counter() - started))
            backend.shutdown()
        click.echo(f"{count:>8}{rates[0]:>20.1f}{rates[1]:>18.1f}{rates[1] / rates[0]:>20.2f}x")


async def closed_loops(backend, call: Callable, count: int, passes: int) -> int:
    """``count`` callers, each sending its next pass as soon as its last is answered, until ``passes`` are served."""
    served = [0]

    async def caller(index: int) -> None:
        while served[0] < passes:
            await backend.forward(call(), peer=f"caller-{index}")
            served[0] += 1

    await asyncio.gather(*(caller(index) for index in range(count)))
    return served[0]


@click.command()
@click.option("--model", default="default", show_default=True, help="Embedded model name or checkpoint directory.")
@click.option("--stranger-period", type=float, default=0.5, show_default=True,
              help="Seconds between the stranger's 1-position calls in (a) (the red team's: 20).")
@click.option("--generations", type=int, default=10, show_default=True, help="The heavy user's generations in (a).")
@click.option("--sybils", type=int, default=8, show_default=True,
              help="Passes the stranger keeps waiting at once in (b), each from a fresh id.")
@click.option("--passes", type=int, default=200, show_default=True, help="Passes computed per scheduler in (b).")
@click.option("--threads", type=int, default=1, show_default=True, help="torch threads of the server.")
def shares(model: str, stranger_period: float, generations: int, sybils: int, passes: int, threads: int) -> None:
    """The red team's two attacks on --max-share-per-caller: an idle server's heavy user, and fresh ids per call."""
    apply_threads(threads)
    idle_server_case(model, stranger_period, generations, threads)
    sybil_case(model, sybils, passes)


def idle_server_case(model: str, period: float, generations: int, threads: int) -> None:
    import torch

    from swarm.client.model import DistributedDiffusionLM
    from swarm.wire.messages import ForwardRequest

    with one_server(model, threads, "--max-share-per-caller", "0.5", "--share-window", "60") as (swarm, server_id):
        heavy = DistributedDiffusionLM.from_pretrained(model, initial_peers=swarm.initial_peers)
        stranger = DistributedDiffusionLM.from_pretrained(model, initial_peers=swarm.initial_peers)
        try:
            heavy.generate(prompts(1)[0], gen_length=8, steps=2, block_length=8)  # warm

            def timed() -> float:
                started = time.perf_counter()
                for index in range(generations):
                    heavy.generate(prompts(generations)[index], **GREEDY)
                return (time.perf_counter() - started) / generations

            alone = timed()
            stop, calls = threading.Event(), [0]

            def poke() -> None:  # a 1-position call through the first block, then a pause
                hidden = torch.zeros(1, 1, stranger.config.hidden_size)
                while not stop.is_set():
                    stranger.loop.run(stranger.caller.forward(server_id, ForwardRequest(0, 1, hidden, "", -1), 30))
                    calls[0] += 1
                    stop.wait(period)

            poker = threading.Thread(target=poke, daemon=True)
            poker.start()
            with_stranger = timed()
            stop.set()
            poker.join(60)
            usage = span_info(heavy, server_id)["usage"]
        finally:
            heavy.shutdown()
            stranger.shutdown()
    click.echo(f"\n(a) --max-share-per-caller 0.5 --share-window 60, a stranger's 1-position call every {period:g} s "
               f"({calls[0]} calls); the heavy user's generation ({GREEDY['gen_length']} tokens), mean of "
               f"{generations}")
    click.echo(f"{'heavy user':<24}{'s per generation':>18}")
    click.echo(f"{'alone':<24}{alone:>18.3f}")
    click.echo(f"{'with the stranger':<24}{with_stranger:>18.3f}")
    click.echo(f"ratio {with_stranger / alone:.2f}x (the refusing cap: 179.5 s vs 0.04 s); refused for share: "
               f"{usage['refused']}")


def schedulers() -> dict[str, type]:
    """The orders compared: first come first served, fair by id (every id a flow: what ids made in advance had
    before issue 55, fresh ids before issue 48), and this project's (a flow of its own only for proved work)."""
    from swarm.server.scheduler import FairScheduler

    class ArrivalOrder(FairScheduler):
        def flow_for(self, job, now: float):
            return "everyone"

    class PerIdentity(FairScheduler):
        def flow_for(self, job, now: float):
            return job.peer

    return {"arrival": ArrivalOrder, "by id": PerIdentity, "proved work": FairScheduler}


def sybil_case(model: str, sybils: int, passes: int) -> None:
    import torch

    from swarm.models.loading import ModelFiles
    from swarm.server.backend import SpanBackend, SpanCall

    files = ModelFiles(model)
    config = files.config
    span = files.span(0, config.num_layers)
    click.echo(f"\n(b) a user proving its passes' work (one pass waiting at a time) against a stranger keeping "
               f"{sybils} passes waiting, each from a fresh id; {passes} passes of 1 x 36 positions through every "
               f"block")
    click.echo(f"{'scheduler':<34}{'user share':>11}{'sybils share':>13}")
    hidden = torch.randn(1, 36, config.hidden_size)
    kinds = schedulers()
    for name, kind in (("arrival order (no scheduler)", kinds["arrival"]), ("fair by id", kinds["by id"]),
                       ("fair, unproved passes share one flow", kinds["proved work"])):
        backend = SpanBackend(span, max_concurrent=4 * sybils + 4, max_queued_tokens=10**9, scheduler=kind(),
                              batching=False)
        served = asyncio.run(contend(backend, lambda: SpanCall(hidden, 0, config.num_layers), sybils, passes,
                                     Contest(user_proves=True)))
        backend.shutdown()
        total = sum(served.values())
        click.echo(f"{name:<34}{served['user'] / total:>11.0%}{served['sybils'] / total:>13.0%}")
    click.echo("the red team measured 91% of the calls for fresh ids against a 50% cap")


@dataclass(frozen=True)
class Contest:
    """Who proves work in :func:`contend`, and whether the stranger's ids are fresh per pass or made in advance."""

    user_proves: bool = False
    sybils_prove: bool = False
    fresh: bool = True


async def contend(backend, call: Callable, sybils: int, passes: int, contest: Contest = Contest()) -> dict[str, int]:
    """Closed loops: the user keeps one pass waiting, the stranger ``sybils`` (a fresh id each, or one id per loop
    made in advance); count who is served. A side that proves work proves each pass's cost."""
    served = {"user": 0, "sybils": 0}
    done = asyncio.Event()
    fresh = iter(range(10**9))
    cost = backend.cost(*call().hidden.shape[:2])

    async def loop(side: str, index: int) -> None:
        while not done.is_set():
            peer = "user" if side == "user" else f"sybil-{next(fresh) if contest.fresh else index}"
            proves = contest.user_proves if side == "user" else contest.sybils_prove
            await backend.forward(call(), peer=peer, proved=cost if proves else 0.0)
            served[side] += 1
            if sum(served.values()) >= passes:
                done.set()

    await asyncio.gather(loop("user", 0), *(loop("sybils", index) for index in range(sybils)))
    return served


@click.command()
@click.option("--model", default="default", show_default=True, help="Embedded model name or checkpoint directory.")
@click.option("--passes", type=click.IntRange(10), default=400, show_default=True,
              help="Passes of 1 x 36 positions computed per case in (a) and (b).")
@click.option("--flood", type=click.IntRange(1), default=100, show_default=True,
              help="Fresh ids the attacker keeps queued in (b).")
@click.option("--small-calls", type=click.IntRange(1), default=20, show_default=True,
              help="The small caller's calls (1 x 36 positions) per case in (c).")
@click.option("--big-rows", type=click.IntRange(1), default=200, show_default=True,
              help="Rows of each big caller's 64-position calls in (c) (fewer on a slow machine).")
@click.option("--max-piece-tokens", type=click.IntRange(1), default=16384, show_default=True,
              help="The servers' --max-piece-tokens in (c)'s after case (smaller with smaller --big-rows).")
@click.option("--cases", default="abc", show_default=True, help="Which of (a), (b), (c) to run.")
@click.option("--threads", type=int, default=1, show_default=True, help="torch threads of the server.")
def fairness(model: str, passes: int, flood: int, small_calls: int, big_rows: int, max_piece_tokens: int, cases: str,
             threads: int) -> None:
    """Issue 55 class 6 before and after: ids made in advance, a flood of fresh ids against a new client, a small
    caller behind three callers of 200 x 64-position calls; on the real compute queue of the model, in process."""
    import torch

    from swarm.models.loading import ModelFiles
    from swarm.server.backend import SpanBackend, SpanCall
    from swarm.wire.work import WORK_PRICE, bits_for, mint

    apply_threads(threads)
    files = ModelFiles(model)
    config = files.config
    span = files.span(0, config.num_layers)
    small = torch.randn(1, 36, config.hidden_size)
    call = lambda: SpanCall(small, 0, config.num_layers)  # noqa: E731
    kinds = schedulers()

    def shares(kind: type, sybils: int, contest: Contest) -> tuple[float, dict[str, int]]:
        backend = SpanBackend(span, max_concurrent=sybils + 4, max_queued_tokens=10**9, scheduler=kind(),
                              batching=False)
        started = time.perf_counter()
        served = asyncio.run(contend(backend, call, sybils, passes, contest))
        backend.shutdown()
        return time.perf_counter() - started, served

    cost = request_cost_of(span, 1, 36)
    bits = bits_for(cost, WORK_PRICE)
    started = time.perf_counter()
    for index in range(20):
        mint("server", "caller", bits, salt=f"{index:016x}")
    mint_s = (time.perf_counter() - started) / 20
    click.echo(f"model {model}; every pass 1 x 36 positions through every block (cost {cost}); a work stamp for it: "
               f"{bits} bits at {WORK_PRICE:g} hashes per unit of cost, {1000 * mint_s:.2f} ms of one core to mint")
    if "a" in cases:
        made_in_advance(shares, kinds, mint_s, passes)
    if "b" in cases:
        click.echo(f"\n(b) a new client keeping one pass waiting while an attacker keeps {flood} fresh ids queued; "
                   f"{passes} passes")
        click.echo(f"{'new client':<44}{'its passes':>11}")
        for name, contest in (("without stamps (as before)", Contest()), ("stamping its calls", Contest(True))):
            _, served = shares(kinds["proved work"], flood, contest)
            click.echo(f"{name:<44}{served['user']:>7} of {sum(served.values())}")
        click.echo("the red team measured 6 of 1,200")
    if "c" in cases:
        small_waits(span, config.num_layers, small_calls, big_rows, max_piece_tokens)


def made_in_advance(shares: Callable, kinds: dict[str, type], mint_s: float, passes: int) -> None:
    """(a): a user against k ids made in advance, fair by id (before) and by proved work (after)."""
    click.echo(f"\n(a) a user keeping one pass waiting against k ids made in advance, each keeping one waiting; "
               f"{passes} passes")
    click.echo(f"{'k':>3}  {'order':<44}{'user share':>11}{'sybils share':>13}{'attacker cores':>16}")
    for sybils in (4, 16):
        for name, kind, contest in (
                ("before: fair by id (ids made in advance)", kinds["by id"], Contest(fresh=False)),
                ("after: the user proves work, sybils do not", kinds["proved work"],
                 Contest(user_proves=True, fresh=False)),
                ("after: both prove work", kinds["proved work"], Contest(True, True, fresh=False))):
            wall, served = shares(kind, sybils, contest)
            cores = served["sybils"] * mint_s / wall if contest.sybils_prove else 0.0
            total = sum(served.values())
            click.echo(f"{sybils:>3}  {name:<44}{served['user'] / total:>11.0%}{served['sybils'] / total:>13.0%}"
                       f"{cores:>16.2f}")
    click.echo("the red team measured 80% (k = 4) and 94% (k = 16) for the sybils")


def request_cost_of(span, batch: int, length: int) -> int:
    from swarm.server.backend import attention_length_scale, request_cost

    return request_cost(batch, length, attention_length_scale(span.config))


def small_waits(span, blocks: int, calls: int, big_rows: int = 200, max_piece_tokens: int = 16384) -> None:
    """(c): a small caller's time per call (1 x 36 positions, a pause between calls) alone, and beside three callers
    each keeping a ``big_rows`` x 64-position pass waiting, long passes whole (before) and in pieces (after); every
    caller proves work, so the order is by cost alone."""
    import statistics

    import torch

    from swarm.server.backend import SpanBackend, SpanCall

    small = torch.randn(1, 36, span.config.hidden_size)
    big = torch.randn(big_rows, 64, span.config.hidden_size)

    async def run(backend, bigs: int) -> list[float]:
        done, waits = asyncio.Event(), []

        async def big_loop(index: int) -> None:
            while not done.is_set():
                await backend.forward(SpanCall(big, 0, blocks), peer=f"big-{index}",
                                      proved=backend.cost(*big.shape[:2]))

        async def small_loop() -> None:
            await asyncio.sleep(0.2 if bigs else 0.0)  # the long passes under way
            for _ in range(calls):
                started = time.perf_counter()
                await backend.forward(SpanCall(small, 0, blocks), peer="small", proved=backend.cost(1, 36))
                waits.append(time.perf_counter() - started)
                await asyncio.sleep(0.05)
            done.set()

        await asyncio.gather(small_loop(), *(big_loop(index) for index in range(bigs)))
        return waits

    click.echo(f"\n(c) a small caller's time per call (1 x 36 positions, {calls} calls) beside 3 callers of "
               f"{big_rows} x 64 positions; median and worst, ms")
    click.echo(f"{'batching':<10}{'case':<40}{'median':>9}{'worst':>9}{'pieces':>9}")
    for batching in (False, True):
        for name, bigs, piece in (("alone", 0, max_piece_tokens), ("before: long passes whole", 3, 10**12),
                                  (f"after: pieces of {max_piece_tokens} positions x blocks", 3, max_piece_tokens)):
            backend = SpanBackend(span, max_concurrent=8, max_queued_tokens=10**9, batching=batching,
                                  max_piece_tokens=piece)
            waits = asyncio.run(run(backend, bigs))
            pieces = backend.queue.pieces
            backend.shutdown()
            click.echo(f"{'on' if batching else 'off':<10}{name:<40}{1000 * statistics.median(waits):>9.1f}"
                       f"{1000 * max(waits):>9.1f}{pieces:>9}")
    click.echo("the red team measured a median of 4 ms alone and 455 ms beside the three callers")
