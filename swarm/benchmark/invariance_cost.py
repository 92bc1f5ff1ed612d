"""``python -m swarm.benchmark invariance-cost``: what batch-invariant passes cost (issues 47 and 54).

One whole-model pass (every row scored) of ``--states`` states of each of ``--lengths`` positions, with and
without :mod:`swarm.models.invariance`, per dtype, interleaved and best of ``--repeats``, printed side by side:
the plain and invariant milliseconds and their ratio, and for several states the invariant call against as many
single-state invariant calls (what batching states costs per state). Default: a 2-block checkpoint of
LLaDA-8B's widths (realscale's builder), then the embedded default model.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import click

from swarm.benchmark.realscale import checkpoint

HEADER = (f"{'model':<30}{'dtype':<10}{'device':<8}{'states':>7}{'length':>7}{'plain ms':>11}{'invariant':>11}"
          f"{'ratio':>8}{'per state':>11}")


def best_ms(run: Callable[[], None], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return 1000 * best


def measure(model: str, dtypes: list[str], states: list[int], lengths: list[int], repeats: int,
            device: str) -> None:
    import torch

    import swarm
    from swarm.models import invariance

    for dtype in dtypes:
        lm = swarm.DiffusionLM.from_pretrained(model, dtype=dtype, device=device)
        click.echo(f"# {model[-60:]} {dtype} on {device}: {lm.batch_invariance().why}")
        for length in lengths:
            single: Optional[float] = None  # the invariant single-state call, for the per-state column
            for count in sorted(states):
                ids = torch.randint(4, 100, (count, length), device=lm.device)
                figures: dict[bool, float] = {}
                for enabled in (False, True, False, True):  # interleaved: a load change hits both sides
                    setting = invariance.BatchInvariance(enabled=enabled)

                    def run() -> None:
                        with torch.no_grad(), invariance.batch_invariance(setting):
                            lm.model(ids, scored=(0, length))
                        if lm.device.type == "cuda":
                            torch.cuda.synchronize()

                    figures[enabled] = min(figures.get(enabled, float("inf")), best_ms(run, repeats))
                if count == 1:
                    single = figures[True]
                per_state = f"{figures[True] / (count * single):>10.2f}x" if single and count > 1 else f"{'':>11}"
                click.echo(f"{model[-28:]:<30}{dtype:<10}{device:<8}{count:>7}{length:>7}{figures[False]:>11.1f}"
                           f"{figures[True]:>11.1f}{figures[True] / figures[False]:>7.2f}x{per_state}")


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


@click.command("invariance-cost")
@click.option("--model", default=None, help="Checkpoint directory; default: a 2-block 8B-width one, then 'default'.")
@click.option("--dtypes", default="bfloat16,float32", show_default=True, help="Comma-separated dtypes.")
@click.option("--states", default="1,4", show_default=True,
              help="Comma-separated numbers of states per call; with 1 among them, 'per state' compares the others "
                   "with as many single-state calls.")
@click.option("--lengths", default="16,64,128,256,512", show_default=True,
              help="Comma-separated positions per state (what users send: 64-512).")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed passes per side (best kept).")
@click.option("--device", default="cpu", show_default=True, help="Where the passes run: cpu or cuda.")
def invariance_cost(model: Optional[str], dtypes: str, states: str, lengths: str, repeats: int, device: str) -> None:
    """Invariant vs plain passes: milliseconds and ratio per dtype, states per call and length."""
    click.echo(HEADER)
    counts, sizes, kinds = int_list(states), int_list(lengths), dtypes.split(",")
    with checkpoint(model, 2) as directory:
        measure(str(directory), kinds, counts, sizes, repeats, device)
    if model is None:
        measure("default", kinds, counts, sizes, repeats, device)
