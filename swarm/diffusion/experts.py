"""Where expert predictions come from: the :class:`ExpertSource` interface and the in-process expert.

A source starts scoring the active block of a call and returns a :class:`~swarm.diffusion.denoiser.Pending`
result, so that a remote expert (``swarm.client.experts.RemoteExpert``) computes while the backbone does.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Union

import torch

from swarm.diffusion.denoiser import DenoiseContext, Pending, Ready
from swarm.diffusion.sparse import SparseScores, block_log_probs

__all__ = ["ExpertNotFoundError", "ExpertSource", "ExpertUnavailable", "InProcessExpert", "block_log_probs",
           "expert_scores"]
from swarm.utils.errors import EXIT_NOT_SERVED, SwarmError


class ExpertNotFoundError(SwarmError, LookupError):
    """An expert asked for by name that is neither loadable here nor announced in the swarm."""

    exit_code = EXIT_NOT_SERVED


class ExpertUnavailable(SwarmError, RuntimeError):
    """An expert that can no longer answer (every server hosting it failed): it is dropped, with a warning."""


class ExpertSource(Protocol):
    def submit(self, tokens: torch.Tensor, context: DenoiseContext, top_k: int = 0) -> Pending:
        """Start scoring positions ``context.block_start:last_block_end`` of each row of ``tokens`` (batch, length):
        every block a row decides.

        The result is the log-probabilities (batch, positions, vocab), or with ``top_k`` above 0 each
        position's ``top_k`` most likely tokens (:class:`~swarm.diffusion.sparse.SparseScores`, made by
        :func:`expert_scores`); it raises :class:`ExpertUnavailable` when none come.
        """
        ...

    def to_dict(self) -> dict[str, Any]:
        """Where the expert runs (model path, servers, failovers), for the result's info."""
        ...


def expert_scores(log_probs: torch.Tensor, top_k: int) -> Union[torch.Tensor, SparseScores]:
    """What an expert answers for ``log_probs`` (from :func:`block_log_probs`): all of them (``top_k`` 0) or each
    position's ``top_k`` most likely tokens; one function for in-process experts and expert servers, so that local
    and swarm compositions see the same numbers."""
    return SparseScores.top_k(log_probs, top_k) if top_k > 0 else log_probs


class InProcessExpert:
    """An expert model running in this process (``swarm.DiffusionLM``'s experts)."""

    def __init__(self, logits: Callable[[torch.Tensor], torch.Tensor], label: str):
        self.logits = logits
        self.label = label

    def submit(self, tokens: torch.Tensor, context: DenoiseContext, top_k: int = 0) -> Pending:
        return Ready(expert_scores(block_log_probs(self.logits(tokens), context.block_start,
                                                   context.last_block_end), top_k))

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.label}
