"""``python -m swarm.benchmark composition-cost``: the client's CPU per step for an expert composition, no network.

At LLaDA-8B's vocabulary the client composes each position's scores over 126,464 tokens: it turns the head
server's cut (or its own logits) into log-probabilities, composes the experts' answers with them, records the
telemetry and predicts the block. ``realscale`` measures a whole generation through a local swarm, where the
client's sampler time also holds the wait for the expert server; this command times the client's own work alone,
stage by stage, with the sampler's own functions on random scores of the real shape, for a top-k and the whole
vocabulary side by side. The top-k row runs over the union of the named ids (:mod:`swarm.diffusion.union`), the
whole-vocabulary row over 126,464-wide rows.
"""
from __future__ import annotations

from typing import Callable

import click

from swarm.benchmark.timing import time_calls
from swarm.utils.threads import apply_threads

LLADA_8B_VOCAB = 126464


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    return 1000 * time_calls(fn, repeats)


@click.command("composition-cost")
@click.option("--vocab", type=click.IntRange(min=2), default=LLADA_8B_VOCAB, show_default=True,
              help="Vocabulary size (LLaDA-8B's by default).")
@click.option("--positions", type=click.IntRange(min=1), default=32, show_default=True,
              help="Positions of the block decided per step.")
@click.option("--top-k", type=click.IntRange(min=1), default=64, show_default=True,
              help="expert_top_k of the sparse row (compared with the whole vocabulary).")
@click.option("--experts", "expert_count", type=click.IntRange(min=1, max=8), default=1, show_default=True,
              help="Experts composed.")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="Timed runs (median).")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="torch CPU threads.")
def composition_cost(vocab: int, positions: int, top_k: int, expert_count: int, repeats: int, threads: int) -> None:
    """Milliseconds per step of each stage of the client's expert composition, top k and whole vocabulary."""
    import torch

    from swarm.diffusion.mixture import compose, summarize
    from swarm.diffusion.prediction import (
        HeadQuery,
        Predictions,
        masked_scores,
        predict_block,
        read_block,
        sparse_states,
    )
    from swarm.diffusion.sparse import SparseScores, block_log_probs
    from swarm.diffusion.union import UnionScores

    apply_threads(threads)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, positions, vocab, generator=generator) * 3
    experts_dense = {f"e{i}": block_log_probs(torch.randn(1, positions, vocab, generator=generator) * 3, 0, positions)
                     for i in range(expert_count)}
    weights = {name: 1.0 for name in experts_dense}
    masked = torch.ones(1, positions, dtype=torch.bool)
    query = HeadQuery((0,), positions, (0,), 0, 0.0, 0.0, 0, (0, positions), top_k)
    cut = Predictions(sparse_states(logits, query), query, vocab)  # what the head server answers
    experts_sparse = {name: SparseScores.top_k(value, top_k) for name, value in experts_dense.items()}
    rows = {f"top {top_k}": (lambda: read_block(cut.cut(), 0, 0, positions), experts_sparse),
            "whole vocabulary": (lambda: logits.clone(), experts_dense)}
    click.echo(f"vocabulary {vocab:,}, {positions} positions, {expert_count} expert(s), {threads} thread(s); "
               f"median of {repeats} runs, ms per step")
    click.echo(f"{'scores':<18}{'to logits':>10}{'compose':>9}{'telemetry':>10}{'predict t=0':>12}"
               f"{'predict t=0.5':>14}{'total t=0':>10}")
    for name, (to_logits, answers) in rows.items():
        base = to_logits()
        composed = compose(base, answers, weights)
        first = composed.log_probs.rows(0) if isinstance(composed.log_probs, UnionScores) else composed.log_probs[0]
        scores = masked_scores(first, 0)
        stages = [median_ms(to_logits, repeats), median_ms(lambda: compose(base, answers, weights), repeats),
                  median_ms(lambda: summarize(composed, weights, masked), repeats),
                  median_ms(lambda: predict_block(masked_scores(first, 0), 0.0, 0, 0), repeats),
                  median_ms(lambda: predict_block(scores, 0.5, 0, 0), repeats)]
        total = sum(stages[:4])
        click.echo(f"{name:<18}{stages[0]:>10.2f}{stages[1]:>9.2f}{stages[2]:>10.2f}{stages[3]:>12.2f}"
                   f"{stages[4]:>14.2f}{total:>10.2f}")
    click.echo("(the whole-vocabulary row's logits come from the client's own head: add its time, realscale's "
               "'head ms', about 200 ms at 8B widths on this CPU)")
