"""``python -m swarm.benchmark``: side-by-side measurements on a local swarm of two servers.

* ``latency``: per-step latency through the swarm and in one local process, and their ratio.
* ``picard``: Picard windows w in {1, 2, 4, 8} at several injected per-hop latencies: sequential round
  trips, denoiser evaluations, wall time, speed-up over w = 1, and whether the tokens are identical.

Latency is injected in user space by the client (``ClientConfig.inject_latency``), since these machines
have no netem; it is added to every call to a server, i.e. per hop.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import time
from typing import Iterator

import click
import torch

from swarm.client import DistributedDiffusionLM
from swarm.diffusion.remasking import STRATEGIES
from swarm.local import DiffusionLM
from swarm.models.loading import ModelFiles
from swarm.utils.local_swarm import LocalSwarm

PROMPT = "The government said"


@contextlib.contextmanager
def two_server_swarm(model: str, threads: int, replica: bool = False) -> Iterator[LocalSwarm]:
    """A bootstrap peer and two servers holding the two halves of ``model`` (plus a full replica)."""
    num_layers = ModelFiles(model).config.num_layers
    half = num_layers // 2
    spans = [f"0:{half}", f"{half}:{num_layers}"] + ([f"0:{num_layers}"] if replica else [])
    with LocalSwarm() as swarm:
        click.echo(f"starting a bootstrap peer and servers {', '.join(spans)} on 127.0.0.1 ...", err=True)
        swarm.start_bootstrap()
        servers = [swarm.start_server(model, span, "--compute-threads", str(threads), wait=False) for span in spans]
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


def time_calls(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Benchmarks that print ratios measured side by side in one run."""
    logging.basicConfig(level=logging.WARNING)


def threads_option(command):
    return click.option("--threads", type=int, default=1, show_default=True,
                        help="torch threads for the local model and for each server (equal, for a fair ratio).")(command)


@main.command()
@threads_option
@click.option("--model", default="default", show_default=True, help="Embedded model name or checkpoint directory.")
@click.option("--length", type=int, default=96, show_default=True, help="Sequence length of one denoising step (prompt + generation).")
@click.option("--repeats", type=int, default=20, show_default=True, help="Timed denoiser calls per setting (median reported).")
@click.option("--latency-ms", type=float, default=0.0, show_default=True, help="Injected delay per hop in milliseconds.")
def latency(model: str, length: int, repeats: int, latency_ms: float, threads: int) -> None:
    """Per-step latency: two servers on loopback vs one local process."""
    torch.set_num_threads(threads)
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
@click.option("--windows", default="1,2,4,8", show_default=True, callback=comma_list(int, 1), help="Comma-separated Picard window sizes.")
@click.option("--latencies-ms", default="0,50", show_default=True, callback=comma_list(float, 0), help="Comma-separated injected delays per hop (ms).")
@click.option("--gen-length", type=int, default=64, show_default=True, help="Tokens generated.")
@click.option("--steps", type=int, default=64, show_default=True, help="Denoising steps.")
@click.option("--block-length", type=int, default=32, show_default=True, help="Semi-autoregressive block size.")
@click.option("--prompt", default=PROMPT, show_default=True, help="Prompt text.")
@click.option("--remasking", default="random,low_confidence", show_default=True,
              help="Comma-separated remasking strategies; Picard's acceptance depends strongly on it.")
def picard(model: str, windows: list[int], latencies_ms: list[float], gen_length: int, steps: int, block_length: int, prompt: str,
           threads: int, remasking: str) -> None:
    """Picard windows vs sequential denoising through two servers."""
    torch.set_num_threads(threads)
    sizes, delays = windows, latencies_ms
    strategies = remasking.split(",")
    unknown = [name for name in strategies if name not in STRATEGIES]
    if unknown:
        raise click.BadParameter(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}", param_hint="--remasking")
    base_settings = dict(gen_length=gen_length, steps=steps, block_length=block_length)
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
@click.option("--latency-ms", type=float, default=50.0, show_default=True, help="Injected delay per hop in milliseconds.")
@click.option("--remasking", type=click.Choice(list(STRATEGIES)), default="random", show_default=True, help="Remasking strategy of the request.")
@click.option("--prompt", default=PROMPT, show_default=True, help="Prompt text.")
def scale(model: str, latency_ms: float, remasking: str, prompt: str, threads: int) -> None:
    """One request at scale local, auto and max, through two servers and a full replica."""
    torch.set_num_threads(threads)
    settings = dict(gen_length=64, steps=64, block_length=32, remasking=remasking)
    with two_server_swarm(model, threads, replica=True) as swarm:
        with DistributedDiffusionLM.from_pretrained(model, initial_peers=swarm.initial_peers,
                                                    inject_latency=latency_ms / 1000) as lm:
            lm.generate(prompt, gen_length=32, steps=8, block_length=32)  # warm-up
            click.echo(f"{'scale':>6}{'wall s':>9}{'round trips':>13}{'spot checks':>13}{'experts':>9}  same tokens as local")
            reference = None
            for name in ("local", "auto", "max"):
                result = lm.generate(prompt, scale=name, **settings)
                reference = reference or result
                experts = ",".join(result.info.get("experts", {}).get("weights", {}) or []) or "-"
                click.echo(f"{name:>6}{result.elapsed_s:>9.2f}{result.denoiser_calls:>13}"
                           f"{len(result.info.get('spot_checks', [])):>13}{experts:>9}  "
                           f"{result.token_ids == reference.token_ids}")


if __name__ == "__main__":
    main()
