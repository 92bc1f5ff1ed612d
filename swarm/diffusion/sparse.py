"""Sparse scores: a distribution over the vocabulary as its k most likely tokens and the mass left to the others.

An expert at LLaDA-8B's vocabulary answers 126,464 log-probabilities per position (16 MB per step for a block of
32 positions in float32); its composition with the backbone (:mod:`swarm.diffusion.mixture`) mostly moves the
few tokens it is sure of. :class:`SparseScores` keeps per row the ``k`` token ids with the highest
log-probabilities, those log-probabilities, and ``rest``, the log of the probability of every other token
together, so that the row is still a distribution.

What a row does not name gets ``rest`` spread evenly (:meth:`SparseScores.dense`): an expert has no opinion on
the order of tokens outside its top k, only on their total mass, and they all stay below its own choices, as they
are in its whole answer. With k covering the vocabulary nothing is filled in: :meth:`SparseScores.dense` gives back
the whole log-probabilities, bit for bit (the composition over their union, :mod:`swarm.diffusion.union`, is then the
dense one within float rounding). The same function makes the sparse form locally and on an expert server, so local
and swarm tokens stay identical at any k. Pure torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The total mass of a row (its k probabilities and the rest) may differ from 1 by this much, relatively: float32
# sums of 126,464 terms round, a remainder that does not fit is a wrong answer.
MASS_TOLERANCE = 1e-3
LOG_PROB_SLACK = 1e-4  # a log-probability may exceed 0 by this much (rounding of log_softmax), not more


def block_log_probs(logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The float32 log-probabilities of positions ``start:end`` of each row: what an expert contributes (local or
    served), and what a backbone cut to its top k is cut from."""
    return torch.log_softmax(logits[:, start:end].float(), dim=-1)


@dataclass(frozen=True)
class SparseScores:
    """Per row (any leading shape): ``ids`` (..., k) int64, strictly increasing; ``log_probs`` (..., k) float32,
    their log-probabilities; ``rest`` (...) float32, the log of the probability of every token not in ``ids``
    (-inf when none is left)."""

    ids: torch.Tensor
    log_probs: torch.Tensor
    rest: torch.Tensor
    vocab_size: int

    @property
    def k(self) -> int:
        return self.ids.shape[-1]

    @classmethod
    def top_k(cls, log_probs: torch.Tensor, k: int) -> "SparseScores":
        """The ``k`` most likely tokens of each row of ``log_probs`` (..., vocab), log-probabilities as
        :func:`~swarm.diffusion.experts.block_log_probs` makes them (kept as they are, not normalised again, so that
        k covering the vocabulary gives back the very same numbers); ``k`` at least the vocabulary keeps every
        token."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        log_probs = log_probs.float()
        vocab = log_probs.shape[-1]
        k = min(k, vocab)
        top = torch.topk(log_probs, k, dim=-1).indices
        ids, _ = torch.sort(top, dim=-1)
        chosen = log_probs.gather(-1, ids)
        if k == vocab:
            rest = torch.full(log_probs.shape[:-1], float("-inf"))
        else:
            rest = log_probs.scatter(-1, ids, float("-inf")).logsumexp(dim=-1)
        return cls(ids, chosen, rest, vocab)

    def check(self, shape: tuple[int, ...], max_k: int) -> None:
        """Raise ValueError unless this is a well-formed answer for rows of ``shape`` with at most ``max_k`` ids:
        ids in the vocabulary, strictly increasing (so no duplicate), log-probabilities at most 0 and not NaN,
        and a rest that makes each row's total mass 1."""
        if self.ids.dtype not in (torch.int64, torch.int32) or not self.log_probs.is_floating_point() \
                or not self.rest.is_floating_point():
            raise ValueError("ids must be integers and scores floats")
        if self.ids.dim() == 0 or tuple(self.ids.shape[:-1]) != tuple(shape) \
                or self.log_probs.shape != self.ids.shape or tuple(self.rest.shape) != tuple(shape):
            raise ValueError(f"shapes ids {tuple(self.ids.shape)}, scores {tuple(self.log_probs.shape)}, rest "
                             f"{tuple(self.rest.shape)} do not fit rows of shape {tuple(shape)}")
        if not 1 <= self.k <= min(max_k, self.vocab_size):
            raise ValueError(f"{self.k} ids per row: between 1 and {min(max_k, self.vocab_size)} were asked for")
        if bool(((self.ids < 0) | (self.ids >= self.vocab_size)).any()):
            raise ValueError(f"token ids outside the vocabulary [0, {self.vocab_size})")
        if self.k > 1 and not bool((self.ids[..., 1:] > self.ids[..., :-1]).all()):
            raise ValueError("token ids must be strictly increasing in each row (sorted, no duplicate)")
        scores = self.log_probs.float()
        rest = self.rest.float()
        if bool(torch.isnan(scores).any() or torch.isnan(rest).any()):
            raise ValueError("NaN among the scores")
        if bool((scores > LOG_PROB_SLACK).any() or (rest > LOG_PROB_SLACK).any()):
            raise ValueError("a log-probability above 0")
        total = torch.cat([scores, rest.unsqueeze(-1)], dim=-1).logsumexp(dim=-1)
        if not bool((total.abs() <= MASS_TOLERANCE).all()):
            raise ValueError("the rest does not fit: a row's probabilities do not sum to 1")

    def dense(self) -> torch.Tensor:
        """Full log-probabilities (..., vocab) in float32: the row's own scores at its ids, ``rest`` spread evenly
        over every other token (the most uncertain reading of "the rest": an expert gives no order among tokens it
        did not rank, and still holds them all below its own choices, as its whole answer would)."""
        fill = self.fill()
        out = fill.unsqueeze(-1).expand(*self.rest.shape, self.vocab_size).contiguous()
        return out.scatter(-1, self.ids.long(), self.log_probs.float())

    def fill(self) -> torch.Tensor:
        """The float32 log-probability (...) of each token the row does not name: ``rest`` spread evenly."""
        others = max(self.vocab_size - self.k, 1)
        return self.rest.float() - torch.log(torch.tensor(float(others)))

    def wire_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """How an expert server sends it: (..., k + 1) float32 scores (the k log-probabilities, then the rest) and
        (..., k) int32 ids (every vocabulary fits)."""
        return torch.cat([self.log_probs.float(), self.rest.float().unsqueeze(-1)], dim=-1), self.ids.int()

    @classmethod
    def from_wire(cls, scores: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> "SparseScores":
        """The inverse of :meth:`wire_tensors`; ValueError when the two tensors cannot be one answer (check the
        result with :meth:`check`)."""
        if scores.dim() == 0 or ids.dim() == 0 or tuple(scores.shape[:-1]) != tuple(ids.shape[:-1]) \
                or scores.shape[-1] != ids.shape[-1] + 1:
            raise ValueError(f"scores {tuple(scores.shape)} and ids {tuple(ids.shape)} are not one sparse answer")
        return cls(ids.long(), scores[..., :-1].float(), scores[..., -1].float(), vocab_size)
