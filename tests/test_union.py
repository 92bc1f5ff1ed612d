"""The composition over the union of the named ids (expert_top_k > 0) is the dense composition of the same inputs.

Every closed form of :mod:`swarm.diffusion.union` (composition, telemetry, predictions, sampling) is checked against
the dense computation over :meth:`UnionScores.dense` / :meth:`SparseScores.dense` on random sparse rows: the same
numbers within float tolerance, the same greedy tokens, the same sampling distribution.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.diffusion.mixture import compose, summarize
from swarm.diffusion.prediction import (
    CutLogits,
    StateCut,
    block_prediction,
    masked_scores,
    predict_block,
    predict_tokens,
    token_probabilities,
)
from swarm.diffusion.sparse import SparseScores
from swarm.diffusion.union import UnionScores, union_ids

MASK = 1


def sparse_row(generator: torch.Generator, positions: int, vocab: int, k: int, scale: float) -> SparseScores:
    """A random answer cut to its top k (scale 0: uniform rows, every token tied)."""
    logits = torch.randn(1, positions, vocab, generator=generator) * scale
    return SparseScores.top_k(torch.log_softmax(logits, dim=-1), k)


@st.composite
def compositions(draw: st.DrawFn) -> dict:
    vocab = draw(st.integers(2, 40))
    positions = draw(st.integers(1, 4))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32)))
    scale = draw(st.sampled_from([0.0, 0.3, 3.0, 20.0]))
    base = sparse_row(generator, positions, vocab, draw(st.integers(1, vocab)), scale)
    experts = {f"e{i}": sparse_row(generator, positions, vocab, draw(st.integers(1, vocab)), scale)
               for i in range(draw(st.integers(1, 3)))}
    weights = {name: draw(st.sampled_from([0.0, 0.4, 1.0, 2.5])) for name in experts}
    return dict(base=base, experts=experts, weights=weights, tau=draw(st.sampled_from([0.5, 3.0, math.inf])))


def dense_and_fast(case: dict):
    dense = compose(case["base"].dense(), case["experts"], case["weights"], case["tau"])
    fast = compose(UnionScores.from_sparse(case["base"]), case["experts"], case["weights"], case["tau"])
    return dense, fast


# 100 examples: derandomized, the same ones every run, each scale, weight and temperature that compositions()
# samples many times over (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None, derandomize=True)
@given(compositions())
def test_the_union_composition_is_the_dense_one(case):
    """Same log-probabilities for every token, same telemetry (norms, clipped shares)."""
    dense, fast = dense_and_fast(case)
    torch.testing.assert_close(fast.log_probs.dense(), dense.log_probs, atol=1e-4, rtol=1e-5)
    where = torch.ones(dense.log_probs.shape[:-1], dtype=torch.bool)
    for name, term in summarize(fast, case["weights"], where).items():
        expected = summarize(dense, case["weights"], where)[name]
        assert term.norm == pytest.approx(expected.norm, rel=1e-4, abs=1e-4)
        assert term.clipped_fraction == pytest.approx(expected.clipped_fraction, abs=1e-6)
        assert term.clipped == expected.clipped


# 100 examples: derandomized, the same ones every run, each scale, weight and temperature that compositions()
# samples many times over (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None, derandomize=True)
@given(compositions(), st.sampled_from([0.0, 0.7]))
def test_closed_form_predictions_equal_the_dense_ones(case, temperature):
    """Predictions from the composed union equal those from its dense rows: the same greedy token (ties to the
    smallest id, the mask token never), its probability, the margin and the entropy within float tolerance; a
    draw at a temperature is the same token for the same seed and never the mask."""
    _, fast = dense_and_fast(case)
    union = fast.log_probs.rows(0)
    fast_rows = predict_block(masked_scores(union, MASK), temperature, 3, 5)
    dense_scores = masked_scores(union.dense(), MASK)
    tokens = fast_rows[:, 0].long()
    assert not bool((tokens == MASK).any())
    assert torch.equal(fast_rows, predict_block(masked_scores(union, MASK), temperature, 3, 5))  # reproducible
    if temperature == 0:
        assert torch.equal(tokens, dense_scores.argmax(-1))
        dense_rows = predict_block(dense_scores, 0.0, 3, 5)
        torch.testing.assert_close(fast_rows, dense_rows, atol=1e-9, rtol=1e-9)
    expected = torch.softmax(dense_scores, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(token_probabilities(masked_scores(union, MASK), tokens), expected, atol=1e-12, rtol=1e-9)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(compositions())
def test_greedy_tokens_of_the_union_composition_are_the_dense_compositions(case):
    """From the same inputs, the two compositions pick the same greedy tokens (up to float near-ties)."""
    dense, fast = dense_and_fast(case)
    scores = masked_scores(dense.log_probs[0], MASK)
    fast_tokens = predict_tokens(masked_scores(fast.log_probs.rows(0), MASK), 0.0, torch.Generator())
    chosen = scores.gather(-1, fast_tokens[:, None]).squeeze(-1)
    assert bool(((fast_tokens == scores.argmax(-1)) | (chosen >= scores.max(-1).values - 1e-5)).all())


def test_a_draw_over_the_union_has_the_dense_distribution():
    """Drawing over the named ids and one entry for the rest gives softmax(scores / T) over the whole vocabulary."""
    vocab, rows, temperature = 9, 40000, 0.8
    row = UnionScores(torch.tensor([1, 4, 6]), torch.tensor([-0.2, -1.5, -9.0], dtype=torch.float64),
                      torch.tensor(-1.1, dtype=torch.float64), vocab)
    many = UnionScores(row.ids.expand(rows, 3), row.scores.expand(rows, 3), row.other.expand(rows), vocab)
    tokens = predict_tokens(many, temperature, torch.Generator().manual_seed(0))
    frequencies = torch.bincount(tokens, minlength=vocab).double() / rows
    expected = torch.softmax(row.dense() / temperature, -1)
    assert (frequencies - expected).abs().max() < 0.01, (frequencies, expected)


# 100 examples: derandomized, the same ones every run (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.integers(2, 30), st.data())
def test_union_ids_name_every_input_id_and_pad_with_unnamed_ones(vocab, data):
    rows = data.draw(st.integers(1, 3))
    parts = []
    for _ in range(data.draw(st.integers(1, 3))):
        k = data.draw(st.integers(1, vocab))
        parts.append(torch.stack([torch.tensor(sorted(data.draw(st.sets(st.integers(0, vocab - 1), min_size=k,
                                                                         max_size=k)))) for _ in range(rows)]))
    ids = union_ids(parts, vocab, extra=(MASK,))
    named = [set().union(*(part[row].tolist() for part in parts)) | {MASK} for row in range(rows)]
    assert ids.shape[-1] == max(len(row) for row in named)
    for row, expected in enumerate(named):
        values = ids[row].tolist()
        assert values == sorted(set(values)) and expected <= set(values) and max(values) < vocab


@settings(max_examples=100, deadline=None, derandomize=True)
@given(compositions())
def test_nth_other_counts_the_unnamed_ids_in_order(case):
    union = UnionScores.from_sparse(case["base"])
    for position in range(union.ids.shape[-2]):
        row = union.rows((0, position))
        unnamed = [t for t in range(union.vocab_size) if t not in set(row.ids.tolist())]
        if unnamed:
            assert row.nth_other(torch.arange(len(unnamed))).tolist() == unnamed


def test_a_cut_state_predicts_only_its_own_block():
    cut = CutLogits.from_sparse(sparse_row(torch.Generator().manual_seed(0), 4, 12, 3, 3.0), [8])
    assert isinstance(cut[0], StateCut) and cut[0].covers(8, 12) and not cut[0].covers(4, 8)
    assert block_prediction(cut[0], 4, 8, 0, 0.0, 0, MASK) is None
    rows = block_prediction(cut[0], 8, 12, 0, 0.0, 0, MASK)
    dense = cut.dense(12)[0, 8:12]
    assert torch.equal(rows[:, 0].long(), masked_scores(dense, MASK).argmax(-1))
    assert bool(cut.dense(12)[0, :8].isnan().all())
