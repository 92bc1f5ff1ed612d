"""Confidence scores that decide which masked positions are unmasked first (higher = sooner)."""
from __future__ import annotations

from typing import Callable

import torch

# probs: (positions, vocab) float64 softmax of the un-noised logits; x0: (positions,) predicted ids;
# uniform: (positions,) draws in [0, 1) from the step's seeded generator.
Scorer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def low_confidence(probs: torch.Tensor, x0: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Probability of the predicted token (LLaDA's default)."""
    return probs.gather(-1, x0[:, None]).squeeze(-1)


def random_order(probs: torch.Tensor, x0: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """A seeded random order, ignoring the model's confidence."""
    return uniform


def margin(probs: torch.Tensor, x0: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Gap between the two most likely tokens."""
    top2 = probs.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def negative_entropy(probs: torch.Tensor, x0: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Minus the entropy of the position's distribution: peaked distributions go first."""
    return (probs * probs.clamp_min(1e-300).log()).sum(-1)


STRATEGIES: dict[str, Scorer] = {
    "low_confidence": low_confidence,
    "random": random_order,
    "margin": margin,
    "entropy": negative_entropy,
}
