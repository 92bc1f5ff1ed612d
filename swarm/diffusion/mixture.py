"""The closed form of expert composition: a clipped geometric mixture relative to the backbone.

For the positions of the block being decided, each step uses

    log p = log_softmax( log p_b + sum_e w_e * clip_tau(log p_e - log p_b) )

an expert moves the backbone's log-probabilities towards its own, by its weight ``w_e >= 0``, and by at most
``w_e * tau`` nats per token, so that one expert that is certain a token is impossible (or certain) cannot
veto the rest on its own. ``w_e = 0`` leaves the backbone untouched; with one expert, ``w_e = 1`` and no
clipping the result is that expert alone. An expert that answers its top k only (:mod:`swarm.diffusion.sparse`)
spreads the rest of its mass evenly over the other tokens; when the backbone is cut the same way
(:class:`~swarm.diffusion.union.UnionScores`), every token that no input names gets one composed score, and the
composition runs over the union of the named ids plus that score (:func:`compose_union`). Pure torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Union

import torch

from swarm.diffusion.config import DEFAULT_TAU
from swarm.diffusion.sparse import SparseScores
from swarm.diffusion.union import UnionScores, union_ids

Scores = Union[torch.Tensor, UnionScores]
"""Whole rows (..., vocab), or rows over named ids and one shared value (the composition of cut inputs)."""


def validate_weights(weights: Mapping[str, Any]) -> dict[str, float]:
    """Weights by expert name, each a finite number >= 0; a clear error otherwise."""
    if not isinstance(weights, Mapping):
        raise ValueError(f"experts must be a mapping of name to weight or 'auto', got {weights!r}")
    out = {}
    for name, weight in weights.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"expert names must be non-empty strings, got {name!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"the weight of expert {name!r} must be a finite number >= 0, got {weight!r}")
        out[name] = float(weight)
    return out


def validate_tau(tau: Any) -> float:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or math.isnan(tau) or tau <= 0:
        raise ValueError(f"expert_tau must be a number > 0 (inf disables clipping), got {tau!r}")
    return float(tau)


@dataclass
class Composed:
    """The composed log-probabilities and, per expert, what it added and where its clipping fired."""

    log_probs: Scores  # (..., vocab), or over the union of the named ids
    contributions: dict[str, Scores]  # w_e * clip_tau(log p_e - log p_b), (..., vocab)
    clipped: dict[str, Scores]  # |log p_e - log p_b| > tau, bool (..., vocab)


def compose(
    base_logits: Scores, expert_log_probs: Mapping[str, Union[torch.Tensor, SparseScores]],
    weights: Mapping[str, float], tau: float = DEFAULT_TAU,
) -> Composed:
    """``log_softmax(log p_b + sum_e w_e clip_tau(log p_e - log p_b))`` over the last dimension.

    Inputs may be logits or log-probabilities (both are normalised first), or an expert's top-k
    (:class:`~swarm.diffusion.sparse.SparseScores`, the rest spread evenly); computed in float32. A cut backbone
    (:class:`~swarm.diffusion.union.UnionScores`) composes over the union of the named ids (:func:`compose_union`).
    """
    if isinstance(base_logits, UnionScores):
        return compose_union(base_logits, expert_log_probs, weights, tau)
    base = torch.log_softmax(base_logits.float(), dim=-1)
    total = base.clone()
    contributions, clipped = {}, {}
    for name, log_probs in expert_log_probs.items():
        if isinstance(log_probs, SparseScores):
            log_probs = log_probs.dense()
        difference = torch.log_softmax(log_probs.float(), dim=-1) - base
        contribution = weights[name] * difference.clamp(-tau, tau)
        total += contribution
        contributions[name] = contribution
        clipped[name] = difference.abs() > tau
    return Composed(torch.log_softmax(total, dim=-1), contributions, clipped)


def compose_union(
    base_logits: UnionScores, expert_log_probs: Mapping[str, Union[UnionScores, SparseScores]],
    weights: Mapping[str, float], tau: float = DEFAULT_TAU,
) -> Composed:
    """:func:`compose` of inputs that each name a few tokens and share one value among the others.

    A token no input names has the shared value in every input, so every step of the composition (normalising,
    differences, clipping, sums) gives it one value too: the result is exact over the union of the named ids plus
    that value, the same function as the dense composition of :meth:`UnionScores.dense` (only rounding differs).
    """
    experts = {name: UnionScores.from_sparse(scores) if isinstance(scores, SparseScores) else scores
               for name, scores in expert_log_probs.items()}
    ids = union_ids([base_logits.ids] + [scores.ids for scores in experts.values()], base_logits.vocab_size)
    base = base_logits.map(torch.Tensor.float).log_softmax().over(ids)
    total = base
    contributions, clipped = {}, {}
    for name, scores in experts.items():
        difference = scores.map(torch.Tensor.float).log_softmax().over(ids).combine(base, torch.sub)
        contribution = difference.map(lambda value: weights[name] * value.clamp(-tau, tau))
        total = total.combine(contribution, torch.add)
        contributions[name] = contribution
        clipped[name] = difference.map(lambda value: value.abs() > tau)
    return Composed(total.log_softmax(), contributions, clipped)


def position_terms(contribution: Scores, clipped: Scores) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: the L2 norm over the vocabulary of an expert's contribution, and the share of its tokens
    clipped (closed forms over the union: the shared value counts once per unnamed token)."""
    if isinstance(contribution, UnionScores):
        norms = contribution.map(torch.square).vocabulary_sum().sqrt()
        return norms, clipped.map(torch.Tensor.float).vocabulary_sum() / contribution.vocab_size
    return contribution.norm(dim=-1), clipped.float().mean(dim=-1)


@dataclass
class ExpertTerm:
    """Telemetry of one expert at one step."""

    weight: float  # the weight applied (0 when off or dropped)
    norm: float  # mean over the decided positions of the L2 norm (over the vocabulary) of its contribution
    clipped: bool  # whether clipping fired at any decided position
    clipped_fraction: float  # share of (position, token) entries clipped
    dropped: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"weight": self.weight, "norm": self.norm, "clipped": self.clipped,
                "clipped_fraction": self.clipped_fraction, "dropped": self.dropped}


def summarize(composed: Composed, weights: Mapping[str, float], where: torch.Tensor) -> dict[str, ExpertTerm]:
    """Per-expert telemetry over the positions selected by ``where`` (bool, shape ``log_probs.shape[:-1]``)."""
    terms = {}
    for name, contribution in composed.contributions.items():
        norms, shares = (values[where] for values in position_terms(contribution, composed.clipped[name]))
        norm = float(norms.mean()) if len(norms) else 0.0
        fraction = float(shares.mean()) if len(shares) else 0.0
        terms[name] = ExpertTerm(float(weights[name]), norm, bool((shares > 0).any()), fraction)
    return terms
