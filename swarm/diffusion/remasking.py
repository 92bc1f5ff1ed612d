"""Confidence scores that decide which masked positions are unmasked first (higher = sooner).

Each strategy reads a block's prediction rows (:data:`swarm.diffusion.prediction.PREDICTION_FIELDS`: token,
probability, margin, negative entropy, float64) and the step's remasking draws ``uniform`` (positions,) in
[0, 1): what a server holding the output head answers is all a strategy needs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the scorers only index tensors: no torch at import, so --help can list the strategies fast
    import torch

Scorer = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]


def low_confidence(prediction: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Probability of the predicted token (LLaDA's default)."""
    return prediction[:, 1]


def random_order(prediction: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """A seeded random order, ignoring the model's confidence."""
    return uniform


def margin(prediction: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Gap between the probabilities of the two most likely tokens."""
    return prediction[:, 2]


def negative_entropy(prediction: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Minus the entropy of the position's distribution: peaked distributions go first."""
    return prediction[:, 3]


STRATEGIES: dict[str, Scorer] = {
    "low_confidence": low_confidence,
    "random": random_order,
    "margin": margin,
    "entropy": negative_entropy,
}
