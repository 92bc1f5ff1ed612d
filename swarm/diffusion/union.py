"""Scores over a whole vocabulary held as a few named tokens and one value that every other token shares.

With ``expert_top_k`` = k > 0 every input of a step's composition (the backbone cut to its top k, each expert's
answer: :class:`~swarm.diffusion.sparse.SparseScores`) names k tokens per position and spreads the rest of its mass
evenly over all the others. A token that no input names therefore has the same score in every input, hence the
same composed score: the composition (:func:`swarm.diffusion.mixture.compose`), its telemetry and the step's
predictions (:func:`swarm.diffusion.prediction.predict_block`) are closed forms over the union of the named ids
plus that one shared value, a few hundred numbers per position instead of 126,464 at LLaDA-8B's vocabulary. The
result is the same function of the inputs as the dense computation over :meth:`UnionScores.dense` (only float
rounding differs), and the same code runs locally and on a client of the swarm, so their tokens stay equal.

Sampling at a temperature draws over the named ids and one entry standing for all the others (their count folded
into its score), then, when that entry wins, one of the others uniformly: the distribution of a Gumbel-max draw
over the whole vocabulary, with ``m + 2`` draws per position instead of one per token (:func:`sample_tokens`).
Pure torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch

from swarm.diffusion.sparse import SparseScores

TINY = 1e-300  # the clamp the dense predictions use before a log (a token of probability 0 adds 0 to the entropy)


@dataclass(frozen=True)
class UnionScores:
    """Per row (any leading shape): ``ids`` (..., m) int64, strictly increasing; ``scores`` (..., m), the score of
    each id; ``other`` (...), the score of *each* token not in ``ids`` (all share it; unused when none is left)."""

    ids: torch.Tensor
    scores: torch.Tensor
    other: torch.Tensor
    vocab_size: int

    @property
    def others(self) -> int:
        """How many tokens share ``other``."""
        return self.vocab_size - self.ids.shape[-1]

    @classmethod
    def from_sparse(cls, sparse: SparseScores) -> "UnionScores":
        """An expert's (or the backbone's) top k, each unnamed token at the share of the rest that
        :meth:`SparseScores.dense` gives it (the very same float32 numbers)."""
        return cls(sparse.ids.long(), sparse.log_probs.float(), sparse.fill(), sparse.vocab_size)

    def dense(self) -> torch.Tensor:
        """The whole rows (..., vocab): what the closed forms stand for (tests compare them with it)."""
        out = self.other.unsqueeze(-1).expand(*self.other.shape, self.vocab_size).contiguous()
        return out.scatter(-1, self.ids, self.scores.to(out.dtype))

    def rows(self, index: Union[slice, tuple]) -> "UnionScores":
        """The rows at ``index`` of the leading dimensions."""
        return UnionScores(self.ids[index], self.scores[index], self.other[index], self.vocab_size)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "UnionScores":
        """``fn`` applied to every token's score (elementwise ``fn`` only: the named and the shared values alike)."""
        return UnionScores(self.ids, fn(self.scores), fn(self.other), self.vocab_size)

    def combine(self, other: "UnionScores", fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> "UnionScores":
        """``fn`` of two rows over the same ids, token by token."""
        return UnionScores(self.ids, fn(self.scores, other.scores), fn(self.other, other.other), self.vocab_size)

    def at(self, ids: torch.Tensor) -> torch.Tensor:
        """The score of each token of ``ids`` (..., n): its own where named, the shared one elsewhere."""
        slot = torch.searchsorted(self.ids.contiguous(), ids.contiguous()).clamp(max=self.ids.shape[-1] - 1)
        named = self.ids.gather(-1, slot) == ids
        return torch.where(named, self.scores.gather(-1, slot), self.other.unsqueeze(-1).to(self.scores.dtype))

    def over(self, ids: torch.Tensor) -> "UnionScores":
        """The same rows over ``ids``, a superset of this one's ids per row."""
        return UnionScores(ids, self.at(ids), self.other, self.vocab_size)

    def log_normalizer(self) -> torch.Tensor:
        """``logsumexp`` over the whole vocabulary (...)."""
        named = torch.logsumexp(self.scores, dim=-1)
        if self.others == 0:
            return named
        return torch.logaddexp(named, self.other + math.log(self.others))

    def log_softmax(self) -> "UnionScores":
        """Normalised over the whole vocabulary."""
        norm = self.log_normalizer()
        return UnionScores(self.ids, self.scores - norm.unsqueeze(-1), self.other - norm, self.vocab_size)

    def vocabulary_sum(self) -> torch.Tensor:
        """The sum of every token's score over the whole vocabulary, per row."""
        named = self.scores.sum(-1)
        return named + self.others * self.other if self.others else named

    def nth_other(self, index: torch.Tensor) -> torch.Tensor:
        """The ``index``-th (0-based, per row) smallest token id that ``ids`` does not name."""
        # before ids[i] lie ids[i] - i unnamed tokens: the answer is index plus the named ids below it
        free_before = self.ids - torch.arange(self.ids.shape[-1])
        return index + torch.searchsorted(free_before, index.unsqueeze(-1), right=True).squeeze(-1)


def union_ids(parts: Sequence[torch.Tensor], vocab_size: int, extra: Sequence[int] = ()) -> torch.Tensor:
    """Per row, every id named by one of ``parts`` ((..., k_i) each, the same leading shape) or in ``extra``, sorted.

    Rows naming fewer ids than the widest one are padded with the smallest ids they do not name: such a token has
    the shared value in every input, so naming it changes the shape and nothing else."""
    lead = parts[0].shape[:-1]
    named = [part.long() for part in parts]
    if extra:
        named.append(torch.tensor(list(extra), dtype=torch.long).expand(*lead, len(extra)))
    named = torch.cat(named, dim=-1).sort(dim=-1).values
    repeated = torch.zeros_like(named, dtype=torch.bool)
    repeated[..., 1:] = named[..., 1:] == named[..., :-1]
    width = int((~repeated).sum(-1).max())
    unique = named.masked_fill(repeated, vocab_size).sort(dim=-1).values[..., :width].contiguous()  # sentinel: last
    missing = (unique == vocab_size).sum(-1, keepdim=True)
    if not bool(missing.any()):
        return unique
    # at most (named ids) of the ids 0..width-1 are named, so at least `missing` of them are free
    candidates = torch.arange(width).expand(*lead, width).contiguous()
    taken = unique.gather(-1, torch.searchsorted(unique, candidates).clamp(max=width - 1)) == candidates
    fillers = candidates.masked_fill(taken | ((~taken).cumsum(-1) > missing), vocab_size)
    return torch.cat([unique, fillers], dim=-1).sort(dim=-1).values[..., :width].contiguous()


def without_token(scores: UnionScores, token: int) -> UnionScores:
    """``scores`` with ``token`` named and impossible (the mask token: a position is never "unmasked" to it)."""
    scores = scores.over(union_ids([scores.ids], scores.vocab_size, extra=(token,)))
    return UnionScores(scores.ids, scores.scores.masked_fill(scores.ids == token, float("-inf")), scores.other,
                       scores.vocab_size)


def probabilities(scores: UnionScores) -> UnionScores:
    """The softmax over the whole vocabulary, as probabilities."""
    return scores.log_softmax().map(torch.exp)


def greedy_tokens(scores: UnionScores) -> torch.Tensor:
    """The whole vocabulary's argmax, ties to the smallest id as ``torch.argmax`` breaks them: the best named id, or
    the smallest unnamed one when the shared value is higher (or equal, with a smaller id)."""
    best, slot = scores.scores.max(dim=-1)
    named = scores.ids.gather(-1, slot.unsqueeze(-1)).squeeze(-1)
    if scores.others == 0:
        return named
    first_other = scores.nth_other(torch.zeros_like(named))
    wins = (scores.other > best) | ((scores.other == best) & (first_other < named))
    return torch.where(wins, first_other, named)


def gumbel(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Standard Gumbel noise, float64, as the dense draw makes it."""
    uniform = torch.rand(shape, generator=generator, dtype=torch.float64)
    return -torch.log(-torch.log(uniform.clamp(1e-300, 1.0 - 1e-16)))


def sample_tokens(scores: UnionScores, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """A draw from ``softmax(scores / temperature)`` over the whole vocabulary, per row.

    Gumbel-max over the named ids and one entry for all the others, whose score is raised by ``temperature *
    log(count)`` (their total weight); when that entry wins, one of the others is drawn uniformly. Per row, m + 1
    Gumbel draws then one uniform draw (always taken, so the stream's use does not depend on the outcome)."""
    m = scores.ids.shape[-1]
    if scores.others:
        together = scores.other.double() + temperature * math.log(scores.others)
    else:
        together = torch.full(scores.other.shape, float("-inf"), dtype=torch.float64)
    candidates = torch.cat([scores.scores.double(), together.unsqueeze(-1)], dim=-1)
    choice = (candidates + temperature * gumbel(tuple(candidates.shape), generator)).argmax(-1)
    pick = torch.rand(choice.shape, generator=generator, dtype=torch.float64)
    named = scores.ids.gather(-1, choice.clamp(max=m - 1).unsqueeze(-1)).squeeze(-1)
    if not scores.others:
        return named
    other = scores.nth_other((pick * scores.others).long().clamp(max=scores.others - 1))
    return torch.where(choice == m, other, named)


def predict_union(scores: UnionScores, tokens: torch.Tensor) -> torch.Tensor:
    """(rows, 4) float64 prediction rows (token, its probability, the margin between the two most likely tokens,
    minus the entropy) for ``tokens`` from float64 scores (rows, m): the dense rows' closed forms."""
    probs = probabilities(scores)
    probability = probs.at(tokens.unsqueeze(-1)).squeeze(-1)
    shared = probs.other.unsqueeze(-1).expand(*probs.other.shape, min(scores.others, 2))
    top2 = torch.cat([probs.scores, shared], dim=-1).topk(2, dim=-1).values
    negative_entropy = probs.map(lambda p: p * p.clamp_min(TINY).log()).vocabulary_sum()
    return torch.stack([tokens.double(), probability, top2[:, 0] - top2[:, 1], negative_entropy], dim=-1)
