"""``python -m swarm.benchmark invariance-cost``: what batch-invariant passes cost (issue 47).

One whole-model pass (every row scored) of ``--states`` states of ``--length`` tokens, with and without
:mod:`swarm.models.invariance`, per dtype, interleaved and best of ``--repeats``, printed side by side with the
ratio. Default: a 2-block checkpoint of LLaDA-8B's widths (realscale's builder), then the embedded default model.
"""
from __future__ import annotations

import time
from typing import Optional

import click

from swarm.benchmark.realscale import checkpoint


def best_ms(run, repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return 1000 * best


def measure(model: str, dtypes: list[str], states: list[int], length: int, repeats: int) -> None:
    import torch

    import swarm
    from swarm.models import invariance

    for dtype in dtypes:
        lm = swarm.DiffusionLM.from_pretrained(model, dtype=dtype)
        for count in states:
            ids = torch.randint(0, 100, (count, length))
            figures = {}
            for enabled in (False, True, False, True):  # interleaved: a load change hits both sides
                setting = invariance.BatchInvariance(enabled=enabled)

                def run() -> None:
                    with torch.no_grad(), invariance.batch_invariance(setting):
                        lm.model(ids, scored=(0, length))

                figures[enabled] = min(figures.get(enabled, float("inf")), best_ms(run, repeats))
            click.echo(f"{model[-40:]:<42}{dtype:<10}{count:>7}{length:>7}{figures[False]:>12.1f}"
                       f"{figures[True]:>12.1f}{figures[True] / figures[False]:>8.2f}x")


@click.command("invariance-cost")
@click.option("--model", default=None, help="Checkpoint directory; default: a 2-block 8B-width one, then 'default'.")
@click.option("--dtypes", default="bfloat16,float32,float16", show_default=True, help="Comma-separated dtypes.")
@click.option("--states", default="1,4", show_default=True, help="Comma-separated numbers of states per call.")
@click.option("--length", type=int, default=12, show_default=True, help="Tokens per state.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed passes per side (best kept).")
def invariance_cost(model: Optional[str], dtypes: str, states: str, length: int, repeats: int) -> None:
    """Invariant vs default passes: milliseconds and ratio per dtype and batch."""
    click.echo(f"{'model':<42}{'dtype':<10}{'states':>7}{'length':>7}{'default ms':>12}{'invariant':>12}{'ratio':>9}")
    counts = [int(n) for n in states.split(",")]
    kinds = dtypes.split(",")
    with checkpoint(model, 2) as directory:
        measure(str(directory), kinds, counts, length, repeats)
    if model is None:
        measure("default", kinds, counts, length, repeats)
