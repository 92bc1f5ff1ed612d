"""The commands of ``python -m swarm.benchmark``: side-by-side measurements on a local swarm of two servers.

* ``latency``: per-step latency through the swarm and in one local process, and their ratio.
* ``picard``: Picard windows w in {1, 2, 4, 8} at several injected per-hop latencies: sequential round
  trips, denoiser evaluations, wall time, speed-up over w = 1, and whether the tokens are identical.
* ``scale``: one request at scale local, auto and max.
* ``drafts``: sequential, Picard windows and draft-and-verify per remasking strategy, on prose and on the addition
  expert's held-out problems: round trips, row evaluations, drafts accepted, identical tokens, task accuracy.
* ``hiding``: the latency-hiding modes (cache, staleness, push) at 0 and 50 ms per crossing, every peer behind a
  delaying TCP proxy (``swarm/testing/delay_proxy.py``): tokens/s, the seconds the delay added per step, the
  crossings a step waited for, the fraction of the added latency hidden, agreement with the exact tokens and task
  accuracy.
* ``cache-refresh``: the activation cache's refresh schedule against the exact run on the addition expert:
  task accuracy, fills, reuses, rows computed and wall time.
* ``composition-cost``: the client's CPU per step for an expert composition at LLaDA-8B's vocabulary, stage by
  stage, top k and whole vocabulary (``composition_cost.py``).
* ``concurrency``: 1, 4 and 16 concurrent clients of one server, batched vs unbatched, same tokens checked; ``shares``:
  the red team's attacks on the share cap, against the fair scheduler; ``fairness``: issue 55 class 6 before and
  after (ids made in advance, a flood of fresh ids, a small caller behind big calls) (``server_load.py``).

``hiding`` puts every peer behind a TCP proxy on 127.0.0.1 that delays every crossing the protocol makes (connection
and stream set-up, DHT lookups, acknowledgements), as a user's link does. The older commands inject latency in user
space (``ClientConfig.inject_latency``), since these machines have no netem: only the crossings the client counts
are delayed, so a call to a server costs two delays, and a pushed pass over k servers k + 1.

torch, the models and the swarm client are imported in the commands' bodies, so that ``--help`` answers at once.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import click

from swarm.benchmark.adapter_wire import adapter_wire
from swarm.benchmark.client_memory import client_memory
from swarm.benchmark.composition_cost import composition_cost
from swarm.benchmark.invariance_cost import invariance_cost
from swarm.benchmark.realscale import realscale
from swarm.benchmark.server_load import concurrency, fairness, shares
from swarm.benchmark.timing import time_calls
from swarm.cli.options import SwarmGroup, gen_length_option
from swarm.diffusion.config import MAX_DRAFT_STEPS, MAX_STALENESS
from swarm.diffusion.remasking import STRATEGIES
from swarm.testing.delay_proxy import DelayedLinks, DelayedSwarm, daemon_process
from swarm.utils.local_swarm import LocalSwarm
from swarm.utils.threads import apply_threads

if TYPE_CHECKING:
    from swarm.frontend.local import DiffusionLM

PROMPT = "The government said"
# Greedy whatever a model's own sampling defaults (generation.json): the figures compare mechanisms, run after run.
GREEDY = {"temperature": 0.0}


@contextlib.contextmanager
def two_server_swarm(model: str, threads: int, replica: bool = False,
                     links: Optional[DelayedLinks] = None) -> Iterator[LocalSwarm]:
    """A bootstrap peer and two servers holding the two halves of ``model`` (plus a full replica); with ``links``
    each behind a delaying proxy of them (every crossing between any two peers delayed)."""
    from swarm.models.loading import ModelFiles

    num_layers = ModelFiles(model).config.num_layers
    half = num_layers // 2
    spans = [f"0:{half}", f"{half}:{num_layers}"] + ([f"0:{num_layers}"] if replica else [])
    with (LocalSwarm() if links is None else DelayedSwarm(links)) as swarm:
        click.echo(f"starting a bootstrap peer and servers {', '.join(spans)} on 127.0.0.1 ...", err=True)
        swarm.start_bootstrap()
        # Behind the proxies the servers announce rarely: their DHT traffic inside a generation would lengthen the
        # chains of crossings the proxies count (CrossingLog.chain) wherever it happens to fall between two of a pass
        quiet = ("--update-period", "120") if links is not None else ()
        servers = [swarm.start_server(model, span, "--compute-threads", str(threads), *quiet, wait=False)
                   for span in spans]
        for server in servers:
            swarm.wait_ready(server)
        yield swarm


def comma_list(kind: type, minimum: float):
    """A click callback parsing ``"1,2,4"`` into numbers no smaller than ``minimum``, with a clear error."""
    def parse(ctx, param, text: str) -> list:
        try:
            values = [kind(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise click.BadParameter(f"expected comma-separated {kind.__name__} values, got {text!r}") from None
        if not values or min(values) < minimum:
            raise click.BadParameter(f"expected values >= {minimum:g}, got {text!r}")
        return values
    return parse


@click.group(cls=SwarmGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Benchmarks that print ratios measured side by side in one run."""
    logging.basicConfig(level=logging.WARNING)


def threads_option(command):
    option = click.option("--threads", type=int, default=1, show_default=True,
                          help="torch threads for the local model and for each server (equal, for a fair ratio).")
    return option(command)


@main.command()
@threads_option
@click.option("--model", default="default", show_default=True, help="Embedded model name or checkpoint directory.")
@click.option("--length", type=int, default=96, show_default=True,
              help="Sequence length of one denoising step (prompt + generation).")
@click.option("--repeats", type=int, default=20, show_default=True,
              help="Timed denoiser calls per setting (median reported).")
@click.option("--latency-ms", type=float, default=0.0, show_default=True,
              help="Injected one-way delay per network crossing in milliseconds (a call crosses twice).")
def latency(model: str, length: int, repeats: int, latency_ms: float, threads: int) -> None:
    """Per-step latency: two servers on loopback vs one local process."""
    import torch

    from swarm.client.model import DistributedDiffusionLM
    from swarm.frontend.local import DiffusionLM

    apply_threads(threads)
    local = DiffusionLM.from_pretrained(model)
    tokens = torch.randint(0, 256, (1, length))
    local_s = time_calls(lambda: local.logits(tokens), repeats)
    with two_server_swarm(model, threads) as swarm:
        with DistributedDiffusionLM.from_pretrained(model, initial_peers=swarm.initial_peers,
                                                    inject_latency=latency_ms / 1000) as remote:
            route = remote.show_route()
            remote_s = time_calls(lambda: remote.logits(tokens), repeats)
    click.echo(f"model {model}, sequence length {length}, {len(route)} hops, injected {latency_ms:g} ms/hop, "
               f"median of {repeats}")
    click.echo(f"{'setting':<22}{'per step (ms)':>14}")
    click.echo(f"{'local (1 process)':<22}{1000 * local_s:>14.1f}")
    click.echo(f"{'swarm (2 servers)':<22}{1000 * remote_s:>14.1f}")
    click.echo(f"ratio swarm / local: {remote_s / local_s:.2f}x")


@main.command()
@threads_option
@click.option("--model", default="default", show_default=True, help="Embedded model name or checkpoint directory.")
@click.option("--windows", default="1,2,4,8", show_default=True, callback=comma_list(int, 1),
              help="Comma-separated Picard window sizes.")
@click.option("--latencies-ms", default="0,50", show_default=True, callback=comma_list(float, 0),
              help="Comma-separated injected one-way delays per network crossing (ms; a call crosses twice).")
@gen_length_option(type=click.IntRange(min=1), default=64, show_default=True, help="Tokens generated.")
@click.option("--steps", type=int, default=64, show_default=True, help="Denoising steps.")
@click.option("--block-length", type=int, default=32, show_default=True, help="Semi-autoregressive block size.")
@click.option("--prompt", default=PROMPT, show_default=True, help="Prompt text.")
@click.option("--remasking", default="random,low_confidence", show_default=True,
              help="Comma-separated remasking strategies; Picard's acceptance depends strongly on it.")
def picard(model: str, windows: list[int], latencies_ms: list[float], gen_length: int, steps: int, block_length: int,
           prompt: str, threads: int, remasking: str) -> None:
    """Picard windows vs sequential denoising through two servers."""
    from swarm.client.model import DistributedDiffusionLM
    from swarm.frontend.local import DiffusionLM

    apply_threads(threads)
    sizes, delays = windows, latencies_ms
    strategies = remasking.split(",")
    unknown = [name for name in strategies if name not in STRATEGIES]
    if unknown:
        raise click.BadParameter(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}",
                                 param_hint="--remasking")
    base_settings = dict(gen_length=gen_length, steps=steps, block_length=block_length, **GREEDY)
    references = {name: DiffusionLM.from_pretrained(model).generate(prompt, remasking=name, **base_settings)
                  for name in strategies}
    with two_server_swarm(model, threads) as swarm:
        click.echo(f"{'remasking':>15}{'ms/hop':>7}{'w':>4}{'round trips':>13}{'evaluations':>13}{'wall s':>9}"
                   f"{'fewer trips':>13}{'speed-up':>10}{'identical':>11}")
        for delay in delays:
            with DistributedDiffusionLM.from_pretrained(model, initial_peers=swarm.initial_peers,
                                                        inject_latency=delay / 1000) as lm:
                lm.generate(prompt, gen_length=block_length, steps=max(1, block_length // 4), block_length=block_length)
                for name in strategies:
                    settings = dict(base_settings, remasking=name)
                    base = None
                    for w in sizes:
                        result = lm.generate(prompt, parallel_window=w, **settings)
                        base = base or result
                        same = result.token_ids == references[name].token_ids
                        click.echo(f"{name:>15}{delay:>7g}{w:>4}{result.denoiser_calls:>13}{result.states_evaluated:>13}"
                                   f"{result.elapsed_s:>9.2f}{base.denoiser_calls / result.denoiser_calls:>12.2f}x"
                                   f"{base.elapsed_s / result.elapsed_s:>9.2f}x{str(same):>11}")


@main.command()
@threads_option
@click.option("--model", default="default", show_default=True, help="Embedded model name or checkpoint directory.")
@click.option("--latency-ms", type=float, default=50.0, show_default=True,
              help="Injected one-way delay per network crossing in milliseconds (a call crosses twice).")
@click.option("--remasking", type=click.Choice(list(STRATEGIES)), default="random", show_default=True,
              help="Remasking strategy of the request.")
@click.option("--prompt", default=PROMPT, show_default=True, help="Prompt text.")
def scale(model: str, latency_ms: float, remasking: str, prompt: str, threads: int) -> None:
    """One request at scale local, auto and max, through two servers and a full replica."""
    from swarm.client.model import DistributedDiffusionLM

    apply_threads(threads)
    settings = dict(gen_length=64, steps=64, block_length=32, remasking=remasking, **GREEDY)
    with two_server_swarm(model, threads, replica=True) as swarm:
        with DistributedDiffusionLM.from_pretrained(model, initial_peers=swarm.initial_peers,
                                                    inject_latency=latency_ms / 1000) as lm:
            lm.generate(prompt, gen_length=32, steps=8, block_length=32)  # warm-up
            click.echo(f"{'scale':>6}{'wall s':>9}{'round trips':>13}{'spot checks':>13}{'experts':>9}"
                       "  same tokens as local")
            reference = None
            for name in ("local", "auto", "max"):
                result = lm.generate(prompt, scale=name, **settings)
                reference = reference or result
                experts = ",".join(result.info.get("experts", {}).get("weights", {}) or []) or "-"
                click.echo(f"{name:>6}{result.elapsed_s:>9.2f}{result.denoiser_calls:>13}"
                           f"{len(result.info.get('spot_checks', [])):>13}{experts:>9}  "
                           f"{result.token_ids == reference.token_ids}")


BATCHING_MODES = {"sequential": {}, "picard w=4": {"parallel_window": 4}, "picard w=8": {"parallel_window": 8},
                  "drafts k=3": {"draft_steps": 3}, "drafts k=7": {"draft_steps": 7}}
PROSE_PROMPTS = (PROMPT, "In the early years of the city", "The river", "Scientists have found that")


@dataclass
class Tally:
    """Totals of one mode over a workload's prompts."""

    calls: int = 0
    evaluations: int = 0
    steps: int = 0
    identical: int = 0
    correct: int = 0
    runs: int = 0
    drafts_accepted: int = 0  # guessed or drafted states that became steps
    drafts_rejected: int = 0  # calls that evaluated a state that did not

    def add(self, result, reference, answer: Optional[str]) -> None:
        self.calls += result.denoiser_calls
        self.evaluations += result.states_evaluated
        self.steps += result.steps
        self.identical += result.sequence.equal(reference.sequence)
        self.correct += answer is not None and result.text == answer
        self.runs += 1
        self.drafts_accepted += sum(window.accepted - 1 for window in result.windows)
        self.drafts_rejected += sum(window.accepted < window.evaluated for window in result.windows)

    @property
    def acceptance(self) -> float:
        """How often the next guessed or drafted state is accepted when the ones before it were: a call then makes
        (1 - a**(k + 1)) / (1 - a) steps on average with k of them, so 2x fewer trips needs a >= 0.54 at k = 3."""
        checked = self.drafts_accepted + self.drafts_rejected
        return self.drafts_accepted / checked if checked else float("nan")


def tally_modes(lm: DiffusionLM, prompts: Sequence[Sequence[int]], answers: Sequence[Optional[str]],
                settings: dict) -> dict[str, Tally]:
    """Every batching mode on every prompt, each compared with the sequential run of the same prompt."""
    tallies = {mode: Tally() for mode in BATCHING_MODES}
    for prompt, answer in zip(prompts, answers):
        reference = lm.generate(list(prompt), **settings)
        for mode, extra in BATCHING_MODES.items():
            result = reference if not extra else lm.generate(list(prompt), **settings, **extra)
            tallies[mode].add(result, reference, answer)
    return tallies


def echo_tallies(workload: str, remasking: str, tallies: dict[str, Tally], task: bool) -> None:
    base = tallies["sequential"].calls
    for mode, tally in tallies.items():
        accepted = "-" if mode == "sequential" else f"{tally.acceptance:.2f}"
        accuracy = f"{tally.correct / tally.runs:.3f}" if task else "-"
        click.echo(f"{workload:<13}{remasking:>15}{mode:>12}{tally.calls:>7}{tally.evaluations:>7}"
                   f"{base / tally.calls:>8.2f}x{tally.steps / tally.calls:>9.2f}{accepted:>9}"
                   f"{tally.identical:>7}/{tally.runs:<4}{accuracy:>7}")


SWARM_MODES = ("sequential", "picard w=4", "drafts k=3")


def time_through_swarm(model: str, strategies: Sequence[str], delays: Sequence[float], gen_length: int) -> None:
    """Wall time of sequential, Picard and draft-and-verify decoding of the prose prompt through two servers."""
    from swarm.client.model import DistributedDiffusionLM
    from swarm.frontend.local import DiffusionLM

    references = {name: DiffusionLM.from_pretrained(model).generate(PROMPT, gen_length=gen_length, remasking=name,
                                                                     **GREEDY) for name in strategies}
    click.echo(f"{'remasking':>15}{'ms/hop':>7}{'mode':>12}{'trips':>7}{'wall s':>8}{'tok/s':>7}{'speed-up':>9}"
               f"{'identical':>10}")
    with two_server_swarm(model, threads=1) as swarm:
        for delay in delays:
            with DistributedDiffusionLM.from_pretrained(model, initial_peers=swarm.initial_peers,
                                                        inject_latency=delay / 1000) as lm:
                lm.generate(PROMPT, gen_length=32, steps=8, block_length=32)  # warm-up
                for name in strategies:
                    base = None
                    for mode in SWARM_MODES:
                        batching = BATCHING_MODES[mode] or {"draft_steps": 0}  # explicit: the scale adds none
                        result = lm.generate(PROMPT, gen_length=gen_length, remasking=name, **GREEDY, **batching)
                        base = base or result
                        same = result.sequence.equal(references[name].sequence)
                        click.echo(f"{name:>15}{delay:>7g}{mode:>12}{result.denoiser_calls:>7}{result.elapsed_s:>8.2f}"
                                   f"{gen_length / result.elapsed_s:>7.1f}{base.elapsed_s / result.elapsed_s:>8.2f}x"
                                   f"{str(same):>10}")


@main.command()
@click.option("--model", default="default", show_default=True, help="Backbone generating prose.")
@click.option("--task-model", default="addition", show_default=True, help="Model answering addition problems.")
@click.option("--task-examples", type=click.IntRange(min=1), default=50, show_default=True,
              help="Held-out addition problems.")
@click.option("--task-lengths", default="8,64", show_default=True, callback=comma_list(int, 1),
              help="Comma-separated gen_length values for the addition problems (8 is the task's own).")
@gen_length_option(type=click.IntRange(min=1), default=64, show_default=True, help="Prose tokens generated.")
@click.option("--remasking", default=",".join(STRATEGIES), show_default=True, help="Comma-separated strategies.")
@click.option("--latencies-ms", default="", help="Also time the prose prompt through two servers on loopback at these "
                                                  "injected one-way delays (comma-separated ms; none by default).")
def drafts(model: str, task_model: str, task_examples: int, task_lengths: list[int], gen_length: int,
           remasking: str, latencies_ms: str) -> None:
    """Round trips of sequential, Picard and draft-and-verify decoding (greedy, one token per step), in one process.

    A call through the swarm is one round trip and the swarm's tokens equal this process's for every setting
    (pytest tests/test_draft_verify.py), so the counts are those of a swarm run. "per call" is steps per call;
    "accepted" is how often a guessed or drafted state is accepted when the ones before it in its call were
    (:attr:`Tally.acceptance`); "identical" counts runs whose final state equals the sequential run's.
    """
    from swarm.eval.tasks import prompt_ids
    from swarm.frontend.local import DiffusionLM
    from swarm.train.data import AdditionTask

    apply_threads(1)
    strategies = remasking.split(",")
    unknown = [name for name in strategies if name not in STRATEGIES]
    if unknown:
        raise click.BadParameter(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}",
                                 param_hint="--remasking")
    prose_lm, task_lm = DiffusionLM.from_pretrained(model), DiffusionLM.from_pretrained(task_model)
    prose = [prose_lm.encode_prompt(text) for text in PROSE_PROMPTS]
    problems = AdditionTask().problems(task_examples, seed=0, held_out=True)
    questions = [prompt_ids(task_lm, problem.prompt) for problem in problems]
    click.echo(f"prose: {model}, {len(prose)} prompts, {gen_length} tokens; addition: {task_model}, "
               f"{task_examples} held-out problems; greedy, one token per step, blocks of 32 (or gen_length)")
    click.echo(f"{'workload':<13}{'remasking':>15}{'mode':>12}{'trips':>7}{'evals':>7}{'fewer':>9}{'per call':>9}"
               f"{'accepted':>9}{'identical':>12}{'task':>7}")
    for name in strategies:
        settings = dict(gen_length=gen_length, remasking=name, **GREEDY)
        echo_tallies(f"prose {gen_length}", name, tally_modes(prose_lm, prose, [None] * len(prose), settings),
                     task=False)
        for length in task_lengths:
            settings = dict(gen_length=length, remasking=name, **GREEDY)
            tallies = tally_modes(task_lm, questions, [problem.answer for problem in problems], settings)
            echo_tallies(f"addition {length}", name, tallies, task=True)
    if latencies_ms:
        delays = comma_list(float, 0)(None, None, latencies_ms)
        time_through_swarm(model, strategies, delays, gen_length)


HIDING_MODES = ("sync,push,dual,dual+refresh3,stale3,push+stale3,push+stale5,dual+push,dual+push+stale1,"
                "dual+push+stale3,dual+refresh3+push+stale3,dual+push+stale3+exact,dual+push+stale3+unchecked")


def parse_mode(spec: str) -> tuple[dict, bool]:
    """``dual+push+stale3`` -> (generate settings, push). Parts: push, prefix, dual, refreshN (the cache's
    cache_refresh), driftX (its adaptive refresh, cache_refresh_drift X), stale1..8, exact and unchecked (the stale
    check; token by default), draftsN (draft-and-verify with N drafted steps per call: exact tokens, no cache or
    staleness), sync.

    A mode without draftsN evaluates one state per call (``draft_steps=0``): ``scale="auto"`` would otherwise draft
    3 steps per call through the swarm for the confidence orders, which makes "sync" four states per call (twice as
    slow at 0 ms, as fast at 50 ms)."""
    settings: dict = {"draft_steps": 0}
    push = False
    for part in spec.split("+"):
        if part == "push":
            push = True
        elif part in ("prefix", "dual"):
            settings["cache"] = part
        elif part.startswith("refresh") and part[7:].isdigit():
            settings["cache_refresh"] = int(part[7:])
        elif part.startswith("drift") and _is_fraction(part[5:]):
            settings["cache_refresh_drift"] = float(part[5:])
        elif part.startswith("stale") and part[5:].isdigit() and 1 <= int(part[5:]) <= MAX_STALENESS:
            settings["staleness"] = int(part[5:])
        elif part in ("exact", "unchecked"):
            settings["stale_check"] = "none" if part == "unchecked" else part
        elif part.startswith("drafts") and part[6:].isdigit() and 1 <= int(part[6:]) <= MAX_DRAFT_STEPS:
            settings["draft_steps"] = int(part[6:])
        elif part != "sync":
            raise click.BadParameter(f"unknown part {part!r} in mode {spec!r}; use push, prefix, dual, refreshN, "
                                     f"driftX, stale1..{MAX_STALENESS}, exact, unchecked, drafts1..{MAX_DRAFT_STEPS} "
                                     "or sync, joined by '+'",
                                     param_hint="--modes")
    return settings, push


def _is_fraction(text: str) -> bool:
    """Whether ``text`` is a number in [0, 1] (a drift bound)."""
    try:
        return 0.0 <= float(text) <= 1.0
    except ValueError:
        return False


@main.command()
@threads_option
@click.option("--model", default="default", show_default=True, help="Embedded model name or checkpoint directory.")
@click.option("--modes", default=HIDING_MODES, show_default=True,
              help="Comma-separated modes, each parts joined by '+': push, prefix, dual, refreshN (refill the "
                   "cache every N steps), driftX (also when the block's predictions drift past X), "
                   f"stale1..{MAX_STALENESS} (staleness, "
                   "guesses checked token by token), exact (checked to be the exact step), unchecked (never "
                   "checked), draftsN (draft-and-verify, N drafted steps per call; exact), sync (none of them).")
@click.option("--latency-ms", type=float, default=50.0, show_default=True,
              help="One-way delay of every crossing on the proxies in front of every peer (ms), compared with 0.")
@gen_length_option(type=click.IntRange(min=1), default=256, show_default=True, help="Tokens generated.")
@click.option("--block-length", type=int, default=32, show_default=True, help="Semi-autoregressive block size.")
@click.option("--prompt", default=PROMPT, show_default=True, help="Prompt text.")
@click.option("--task-model", default="addition", show_default=True,
              help="Model whose addition-task exact match is reported per mode ('none' to skip).")
@click.option("--task-examples", type=click.IntRange(min=1), default=200, show_default=True,
              help="Held-out addition problems per mode.")
def hiding(model: str, modes: str, latency_ms: float, gen_length: int, block_length: int, prompt: str,
           task_model: str, task_examples: int, threads: int) -> None:
    """Latency hiding: each mode's wall time at 0 and --latency-ms per crossing, through two servers behind delaying
    proxies. "added s/step" is what the delay added to a step (a slower mode at 0 ms cannot flatter it, as it can
    the hidden share); "crossings" those the generation waited for one after the other, per step (a synchronous
    pushed step over two servers: 3)."""
    from swarm.client.model import DistributedDiffusionLM
    from swarm.eval.tasks import evaluate_task
    from swarm.frontend.local import DiffusionLM
    from swarm.train.data import AdditionTask

    apply_threads(threads)
    parsed = {spec: parse_mode(spec) for spec in modes.split(",") if spec}
    base = dict(gen_length=gen_length, steps=gen_length, block_length=block_length, **GREEDY)
    exact = DiffusionLM.from_pretrained(model).generate(prompt, **base)
    accuracy = {}
    if task_model != "none":  # computed locally: the swarm gives the same tokens for every mode (tests)
        task_lm = DiffusionLM.from_pretrained(task_model)
        by_settings: dict[tuple, float] = {}  # push changes no token: modes differing only by it share a score
        for spec, (settings, _) in parsed.items():
            key = tuple(sorted(settings.items()))
            if key not in by_settings:
                report = evaluate_task(task_lm, AdditionTask(), examples=task_examples, generate_options=settings)
                by_settings[key] = report.accuracy
            accuracy[spec] = by_settings[key]
    delays = [0.0, latency_ms]
    times: dict[tuple[str, float], float] = {}
    trips: dict[str, float] = {}  # crossings waited for one after the other per step, at latency_ms
    agreement = {}
    links = DelayedLinks(0.0)
    try:
        with two_server_swarm(model, threads, links=links) as swarm:
            # Checks off (push needs them off; the figures were measured so): spot checks cost is GOVERNANCE.md's
            with DistributedDiffusionLM.from_pretrained(model, initial_peers=swarm.initial_peers,
                                                        spot_check_fraction=0) as lm:
                lm.generate(prompt, gen_length=block_length, steps=4, block_length=block_length)  # warm-up
                for spec, (settings, push) in parsed.items():
                    lm.client_config.push = push
                    for delay in delays:  # side by side: a load that changes meanwhile moves both alike
                        links.delay = delay / 1000  # the open connections' next bytes take it
                        result, waited = waited_crossings(lm, links, prompt, **base, **settings)
                        times[spec, delay] = result.elapsed_s
                        if delay:
                            trips[spec] = waited / gen_length
                        same = sum(a == b for a, b in zip(result.sequence.tolist(), exact.sequence.tolist()))
                        agreement[spec] = (same - len(result.prompt_ids)) / gen_length
                        click.echo(f"  {spec} at {delay:g} ms: {result.elapsed_s:.2f} s, {waited} crossings waited for",
                                   err=True)
    finally:
        links.close()
    sync = next(iter(parsed))
    added_sync = times[sync, latency_ms] - times[sync, 0.0]
    click.echo(f"model {model}, gen_length {gen_length}, block_length {block_length}, steps {gen_length}, two servers "
               f"and the bootstrap peer each behind a TCP proxy delaying every crossing by {latency_ms:g} ms; "
               f"'{sync}' is the reference")
    click.echo(f"{'mode':<26}{'tok/s 0ms':>10}{'tok/s ' + format(latency_ms, 'g') + 'ms':>13}{'vs ' + sync:>9}"
               f"{'added s/step':>13}{'crossings':>10}{'hidden':>8}{'agree':>7}{'task':>7}")
    for spec in parsed:
        slow, fast = times[spec, latency_ms], times[spec, 0.0]
        hidden = 1 - (slow - fast) / added_sync if added_sync > 0 else float("nan")
        task = f"{accuracy[spec]:.3f}" if spec in accuracy else "-"
        click.echo(f"{spec:<26}{gen_length / fast:>10.1f}{gen_length / slow:>13.1f}"
                   f"{times[sync, latency_ms] / slow:>8.2f}x{(slow - fast) / gen_length:>13.3f}{trips[spec]:>10.2f}"
                   f"{hidden:>8.0%}{agreement[spec]:>7.2f}{task:>7}")


def waited_crossings(lm, links: DelayedLinks, prompt: str, **settings):
    """A generation through ``links``, and the crossings it waited for one after the other, from the client and
    back (:meth:`~swarm.testing.delay_proxy.CrossingLog.chain`): what the delay multiplies, whatever overlapped."""
    start = time.monotonic()
    result = lm.generate(prompt, **settings)
    end = time.monotonic()
    return result, links.log.chain(start, end, daemon_process(lm.p2p))


@main.command("cache-refresh")
@threads_option
@click.option("--task-model", default="addition", show_default=True, help="Model whose addition task is scored.")
@click.option("--task-examples", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Held-out addition problems per setting (1000: a tenth of a point; about 15 s a setting).")
@click.option("--refresh", "refreshes", callback=comma_list(int, 0), default="0,2,3,4", show_default=True,
              help="cache_refresh values to compare with the exact run (0: one fill per block).")
@click.option("--drift", "drifts", callback=comma_list(float, 0), default="0.02,0.05,0.1,0.2", show_default=True,
              help="cache_refresh_drift bounds to compare (the adaptive refresh, with cache_refresh 0).")
@click.option("--cache", type=click.Choice(["prefix", "dual"]), default="dual", show_default=True,
              help="Which activation cache.")
def cache_refresh(task_model: str, task_examples: int, refreshes: list[int], drifts: list[float], cache: str,
                  threads: int) -> None:
    """The activation cache's refresh schedule, fixed and adaptive, against the exact run, in one process (the swarm
    gives the same tokens for every setting): task accuracy, fills and reuses, rows the model computed, and wall
    time."""
    from swarm.eval.tasks import prompt_ids
    from swarm.frontend.local import DiffusionLM
    from swarm.train.data import AdditionTask

    apply_threads(threads)
    lm = DiffusionLM.from_pretrained(task_model)
    problems = AdditionTask().problems(task_examples, seed=0, held_out=True)
    prompts = [prompt_ids(lm, problem.prompt) for problem in problems]
    base = dict(gen_length=8, steps=8, block_length=8, remasking="low_confidence", **GREEDY)
    settings = {"exact": {}, **{f"{cache} refresh {r}": {"cache": cache, "cache_refresh": r} for r in refreshes},
                **{f"{cache} drift {d:g}": {"cache": cache, "cache_refresh_drift": d} for d in drifts}}
    for extra in settings.values():  # every setting's bounds before the first (long) row, not after it
        try:
            lm.check_request(**base, **extra)
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--refresh/--drift") from None
    click.echo(f"{task_model}: {task_examples} held-out problems, 8 tokens in one block of 8, one per step, greedy")
    click.echo(f"{'setting':<18}{'task':>7}{'fills':>7}{'reuses':>8}{'rows':>8}{'fewer rows':>11}{'time s':>8}"
               f"{'speed-up':>9}")
    exact_rows = exact_time = 0.0
    for name, extra in settings.items():
        correct = fills = reuses = rows = 0
        started = time.perf_counter()
        for prompt, problem in zip(prompts, problems):
            result = lm.generate(prompt, **base, **extra)
            correct += result.text == problem.answer
            length = len(prompt) + base["gen_length"]
            stats = result.info["cache"]
            if extra:  # a fill computes every row, a reuse the block's (dual) or the block onwards (prefix)
                fills, reuses = fills + stats["fills"], reuses + stats["reuses"]
                rows += stats["fills"] * length + stats["reuses"] * base["block_length"]
            else:
                rows += result.steps * length
        elapsed = time.perf_counter() - started
        exact_rows, exact_time = (rows, elapsed) if not extra else (exact_rows, exact_time)
        click.echo(f"{name:<18}{correct / len(problems):>7.3f}{fills:>7}{reuses:>8}{rows:>8}"
                   f"{exact_rows / rows:>10.2f}x{elapsed:>8.1f}{exact_time / elapsed:>8.2f}x")


main.add_command(realscale)  # issue 17: per-step costs at LLaDA-8B's widths (realscale.py)
main.add_command(adapter_wire)  # issue 19: a LoRA on the wire at those widths (adapter_wire.py)
main.add_command(composition_cost)  # issue 36: the client's CPU for an expert composition (composition_cost.py)
main.add_command(concurrency)  # issue 47: batching several clients' calls on one server (server_load.py)
main.add_command(shares)  # issue 48: the fair scheduler against the red team's shapes (server_load.py)
main.add_command(fairness)  # issue 55 class 6: ids made in advance, a flood, big calls; before/after (server_load.py)
main.add_command(invariance_cost)  # issue 47: batch-invariant passes vs default ones (invariance_cost.py)
main.add_command(client_memory)  # issue 54: a client's peak memory and s/step per mode at 8B widths (client_memory.py)
