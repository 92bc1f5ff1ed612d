"""The closed form of expert composition: a clipped geometric mixture relative to the backbone.

For the positions of the block being decided, each step uses

    log p = log_softmax( log p_b + sum_e w_e * clip_tau(log p_e - log p_b) )

an expert moves the backbone's log-probabilities towards its own, by its weight ``w_e >= 0``, and by at most
``w_e * tau`` nats per token, so that one expert that is certain a token is impossible (or certain) cannot
veto the rest on its own. ``w_e = 0`` leaves the backbone untouched; with one expert, ``w_e = 1`` and no
clipping the result is that expert alone. An expert that answers its top k only (:mod:`swarm.diffusion.sparse`)
spreads the rest of its mass evenly over the other tokens. Pure torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Union

import torch

from swarm.diffusion.config import DEFAULT_TAU
from swarm.diffusion.sparse import SparseScores


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

    log_probs: torch.Tensor  # (..., vocab)
    contributions: dict[str, torch.Tensor]  # w_e * clip_tau(log p_e - log p_b), (..., vocab)
    clipped: dict[str, torch.Tensor]  # |log p_e - log p_b| > tau, bool (..., vocab)


def compose(
    base_logits: torch.Tensor, expert_log_probs: Mapping[str, Union[torch.Tensor, SparseScores]],
    weights: Mapping[str, float], tau: float = DEFAULT_TAU,
) -> Composed:
    """``log_softmax(log p_b + sum_e w_e clip_tau(log p_e - log p_b))`` over the last dimension.

    Inputs may be logits or log-probabilities (both are normalised first), or an expert's top-k
    (:class:`~swarm.diffusion.sparse.SparseScores`, the rest spread evenly); computed in float32.
    """
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
        rows = contribution[where]
        clipped = composed.clipped[name][where]
        norm = float(rows.norm(dim=-1).mean()) if len(rows) else 0.0
        fraction = float(clipped.float().mean()) if clipped.numel() else 0.0
        terms[name] = ExpertTerm(float(weights[name]), norm, bool(clipped.any()), fraction)
    return terms
