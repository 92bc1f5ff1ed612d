"""Sampler settings of task answers (:class:`TaskGeneration`): plain data, so that ``python -m swarm.eval --help``
declares its defaults without loading torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskGeneration:
    """Sampler settings for short answers: one block, one token per step, greedy.

    Greedy and low-confidence explicitly, whatever a model's own defaults (``generation.json``): exact match
    scores the model's best answer, not a sample.
    """

    gen_length: int = 8
    steps: int = 8
    block_length: int = 8
    temperature: float = 0.0
    remasking: str = "low_confidence"
