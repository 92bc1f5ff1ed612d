"""Where expert predictions come from: the :class:`ExpertSource` interface and the in-process expert.

A source starts scoring the active block of a call and returns a :class:`~swarm.diffusion.denoiser.Pending`
result, so that a remote expert (``swarm.client.experts.RemoteExpert``) computes while the backbone does.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from swarm.diffusion.denoiser import DenoiseContext, Pending, Ready
from swarm.utils.errors import EXIT_NOT_SERVED, SwarmError


class ExpertNotFoundError(SwarmError, LookupError):
    """An expert asked for by name that is neither loadable here nor announced in the swarm."""

    exit_code = EXIT_NOT_SERVED


class ExpertUnavailable(SwarmError, RuntimeError):
    """An expert that can no longer answer (every server hosting it failed): it is dropped, with a warning."""


class ExpertSource(Protocol):
    def submit(self, tokens: torch.Tensor, context: DenoiseContext) -> Pending:
        """Start scoring the block ``context.block_start:block_end`` of each row of ``tokens`` (batch, length).

        The result is the log-probabilities (batch, block_end - block_start, vocab); it raises
        :class:`ExpertUnavailable` when none come.
        """
        ...

    def to_dict(self) -> dict[str, Any]:
        """Where the expert runs (model path, servers, failovers), for the result's info."""
        ...


def block_log_probs(logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The float32 log-probabilities of positions ``start:end``: what an expert contributes (local or served)."""
    return torch.log_softmax(logits[:, start:end].float(), dim=-1)


class InProcessExpert:
    """An expert model running in this process (``swarm.DiffusionLM``'s experts)."""

    def __init__(self, logits: Callable[[torch.Tensor], torch.Tensor], label: str):
        self.logits = logits
        self.label = label

    def submit(self, tokens: torch.Tensor, context: DenoiseContext) -> Pending:
        return Ready(block_log_probs(self.logits(tokens), context.block_start, context.block_end))

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.label}
