"""What the sampler calls: a denoiser, the pending result of one call, and the pipelined interface.

A plain :class:`Denoiser` is any callable ``logits = denoiser(tokens, context)``. A :class:`PipelinedDenoiser`
can also *start* a call and hand back a :class:`Pending` result to collect later, so that several calls are in
flight at once (stale pipelining, experts computing alongside the backbone). Every call that may still be
running, a denoiser call or an expert query, local or remote, is a :class:`Pending`; :class:`Ready` is one
that is already done. The sampler wraps a plain denoiser with :func:`pipelined` once, instead of probing
each call for a ``submit`` method.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Union

import torch

from swarm.diffusion.prediction import HeadQuery


@dataclass(frozen=True)
class DenoiseContext:
    """What the denoiser may want to know about the rows it scores (caching layers use it). ``head`` is set
    when the sampler can decide from a head server's predictions instead of logits."""

    steps: tuple[int, ...]
    block_start: int
    block_end: int
    prompt_length: int
    head: Optional[HeadQuery] = None
    # Each row's own block when they differ (a Picard window or drafts crossing into the next block); empty: every
    # row decides block_start:block_end.
    row_blocks: tuple[tuple[int, int], ...] = ()

    def block_of(self, row: int) -> tuple[int, int]:
        """The positions row ``row`` decides."""
        return self.row_blocks[row] if self.row_blocks else (self.block_start, self.block_end)

    @property
    def last_block_end(self) -> int:
        """The end of the last block any row decides: what expert queries cover, from ``block_start``."""
        return max((end for _, end in self.row_blocks), default=self.block_end)


class Denoiser(Protocol):
    def __call__(self, tokens: torch.Tensor, context: DenoiseContext) -> torch.Tensor:
        """tokens (batch, length) int64 -> logits (batch, length, vocab), position i scoring token i (or, only
        when ``context.head`` is set, a head server's :class:`~swarm.diffusion.prediction.Predictions`)."""
        ...


class Pending(ABC):
    """A result that may still be computing: ``result`` waits for it, ``cancel`` says it is no longer needed."""

    @abstractmethod
    def result(self) -> torch.Tensor:
        """The tensor, once computed (raises what the computation raised)."""

    def cancel(self) -> None:
        """Not needed any more: stop the work if it has not started (by default there is nothing to stop)."""


class Ready(Pending):
    """An already computed answer, for work done in-process."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def result(self) -> torch.Tensor:
        return self.value


class PipelinedDenoiser(ABC):
    """A denoiser whose calls can be started now and collected later (several may be in flight)."""

    @abstractmethod
    def submit(self, tokens: torch.Tensor, context: DenoiseContext) -> Pending:
        """Start one call; the logits are ``submit(...).result()``."""

    def __call__(self, tokens: torch.Tensor, context: DenoiseContext) -> torch.Tensor:
        return self.submit(tokens, context).result()

    def observe(self, pending: Pending, margins: torch.Tensor, masked: torch.Tensor) -> None:
        """What the sampler read from a collected call (its first state's active-block top-two margins and which
        of those positions are masked), for a denoiser whose next calls depend on it (the adaptive cache refresh);
        by default nothing."""


class Immediate(PipelinedDenoiser):
    """A plain denoiser as a pipelined one: each call runs at once, in the caller's thread."""

    def __init__(self, denoiser: Denoiser):
        self.denoiser = denoiser

    def submit(self, tokens: torch.Tensor, context: DenoiseContext) -> Pending:
        return Ready(self.denoiser(tokens, context))


AnyDenoiser = Union[Denoiser, PipelinedDenoiser]
"""What the sampler accepts: a plain callable or a pipelined denoiser."""


def pipelined(denoiser: AnyDenoiser) -> PipelinedDenoiser:
    """``denoiser`` itself when it can start calls, else wrapped so that each call runs at once."""
    return denoiser if isinstance(denoiser, PipelinedDenoiser) else Immediate(denoiser)


class ExpertsFirst(PipelinedDenoiser):
    """A denoiser that starts a call's expert queries (``start_queries``), then the backbone's call: both are in
    flight together when the backbone's denoiser is pipelined, so experts compute while the backbone does."""

    def __init__(self, start_queries: Callable[[torch.Tensor, DenoiseContext], None], denoiser: AnyDenoiser):
        self.start_queries = start_queries
        self.denoiser = pipelined(denoiser)

    def submit(self, tokens: torch.Tensor, context: DenoiseContext) -> Pending:
        self.start_queries(tokens, context)
        return self.denoiser.submit(tokens, context)

    def observe(self, pending: Pending, margins: torch.Tensor, masked: torch.Tensor) -> None:
        self.denoiser.observe(pending, margins, masked)
