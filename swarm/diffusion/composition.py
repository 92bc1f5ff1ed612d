"""Composing a backbone with experts at every denoising step: the per-generation orchestrator. Pure torch.

:class:`Composition` holds one request's experts and correctors: it starts each call's expert queries before
the backbone's call (:class:`~swarm.diffusion.denoiser.ExpertsFirst`), composes their answers with the
backbone's logits through the sampler's logits hook (the closed form is :mod:`swarm.diffusion.mixture`),
records per-step telemetry, and picks the sampler (:class:`~swarm.diffusion.corrector.CorrectorSampler`
with ``corrector_steps``). Weights always come from the caller or the prompt classifier
(:mod:`swarm.diffusion.auto_experts`): uniform averaging is never a default.

The pieces live in small modules; this one also re-exports their public names, the face of expert
composition that callers import (``from swarm.diffusion.composition import compose, auto_experts, ...``).
The compatibility tag experts announce is part of their DHT record: :mod:`swarm.dht.compatibility`.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch

from swarm.diffusion.auto_experts import AUTO_RULES, auto_experts, expert_weights
from swarm.diffusion.config import DEFAULT_EXPERT_TOP_K, GenerationConfig
from swarm.diffusion.corrector import CorrectorSampler
from swarm.diffusion.denoiser import AnyDenoiser, DenoiseContext, ExpertsFirst, Pending
from swarm.diffusion.experts import (
    ExpertNotFoundError,
    ExpertSource,
    ExpertUnavailable,
    InProcessExpert,
    block_log_probs,
    expert_scores,
)
from swarm.diffusion.mixture import (
    DEFAULT_TAU,
    Composed,
    ExpertTerm,
    compose,
    summarize,
    validate_tau,
    validate_weights,
)
from swarm.diffusion.prediction import CallLogits, read_block, write_block
from swarm.diffusion.sampler import DiffusionSampler
from swarm.diffusion.sparse import SparseScores

__all__ = [
    "AUTO_RULES", "DEFAULT_TAU", "Composed", "Composition", "CorrectorSampler", "ExpertNotFoundError", "ExpertSource",
    "ExpertTerm", "ExpertUnavailable", "ExpertsFirst", "InProcessExpert", "SparseScores", "auto_experts",
    "block_log_probs", "compose", "expert_scores", "expert_weights", "summarize", "validate_tau", "validate_weights",
]

logger = logging.getLogger(__name__)

MAX_PENDING_CALLS = 16  # expert queries kept for calls in flight; older ones belong to dropped calls


def answer_rows(answer: Union[torch.Tensor, SparseScores], row: int, start: int, end: int
                ) -> Union[torch.Tensor, SparseScores]:
    """Row ``row``'s positions ``start:end`` of an expert's answer (as a batch of one)."""
    if isinstance(answer, SparseScores):
        return SparseScores(answer.ids[row:row + 1, start:end], answer.log_probs[row:row + 1, start:end],
                            answer.rest[row:row + 1, start:end], answer.vocab_size)
    return answer[row:row + 1, start:end]


class Composition:
    """Experts and correctors for one generation: the sampler's logits hook, its sampler, and its telemetry.

    :meth:`wrap` starts the expert queries of a step before the backbone's call, so that remote experts
    compute while the backbone does; :meth:`hook` collects them and composes. Zero-weight experts are not
    queried. An expert that fails for good is dropped for the rest of the generation, with a warning.
    """

    def __init__(
        self, sources: Mapping[str, ExpertSource], weights: Mapping[str, float], generation: GenerationConfig,
        mask_token_id: int, *, tau: float = DEFAULT_TAU, corrector_steps: int = 0, warnings: Sequence[str] = (),
        auto: bool = False, top_k: int = DEFAULT_EXPERT_TOP_K,
    ):
        self.weights = validate_weights(weights)
        missing = set(self.weights) - set(sources)
        if missing:
            raise ValueError(f"no source for experts {sorted(missing)}")
        self.sources = dict(sources)
        self.tau = validate_tau(tau)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"expert_top_k must be an integer >= 0 (0: the whole vocabulary), got {top_k!r}")
        self.top_k = top_k
        if isinstance(corrector_steps, bool) or not isinstance(corrector_steps, int) or corrector_steps < 0:
            raise ValueError(f"corrector_steps must be an integer >= 0, got {corrector_steps!r}")
        if corrector_steps and (generation.parallel_window != 1 or generation.draft_steps or generation.staleness):
            raise ValueError("corrector_steps need parallel_window=1, draft_steps=0 and staleness=0: a corrected "
                             "step makes denoiser calls of its own, while Picard windows, drafts and stale "
                             "pipelining assume one call per step")
        self.generation = generation
        self.mask_token_id = mask_token_id
        self.corrector_steps = corrector_steps
        self.auto = auto
        self.warnings = list(warnings)
        self.dropped: set[str] = set()
        self.records: dict[int, dict[str, Any]] = {}
        # Expert queries started with each backbone call, by call (stale pipelining keeps several in flight).
        self._pending: OrderedDict[int, tuple[DenoiseContext, dict[str, Pending]]] = OrderedDict()
        self._correcting = False

    def active(self) -> list[str]:
        """Experts queried this step: positive weight, not dropped."""
        return [name for name, weight in self.weights.items() if weight > 0 and name not in self.dropped]

    # ----- sampler plumbing ---------------------------------------------------------------------------
    def sampler(self, denoiser: AnyDenoiser, eos_token_ids: Sequence[int] = ()) -> DiffusionSampler:
        hook = self.hook if self.weights else None
        cut = self.top_k if self.active() else 0  # the backbone is cut as the experts are: a head server can answer it
        if self.corrector_steps:
            return CorrectorSampler(self.wrap(denoiser), self.generation, self.mask_token_id, eos_token_ids, hook,
                                    cut, corrector_steps=self.corrector_steps, composition=self)
        return DiffusionSampler(self.wrap(denoiser), self.generation, self.mask_token_id, eos_token_ids, hook, cut)

    def wrap(self, denoiser: AnyDenoiser) -> ExpertsFirst:
        """The backbone's denoiser, each call preceded by starting its expert queries."""
        return ExpertsFirst(self.start_queries, denoiser)

    def start_queries(self, tokens: torch.Tensor, context: DenoiseContext) -> None:
        """Query the active experts on the call's conditional rows (guidance appends unconditional copies)."""
        names = self.active()
        if names:
            rows = tokens[: len(context.steps)]
            self._pending[id(context)] = (context, {name: self.sources[name].submit(rows, context, self.top_k)
                                                    for name in names})
            while len(self._pending) > MAX_PENDING_CALLS:  # calls dropped uncollected (overturned guesses)
                self._pending.popitem(last=False)

    def hook(self, logits: CallLogits, states: torch.Tensor, context: DenoiseContext) -> CallLogits:
        """Compose each row's block of logits with every active expert's log-probabilities; record telemetry.

        Row by row, each at the block it decides (a Picard window's later rows may be in the next block), so that
        a row composes exactly as it would alone: what keeps a window's tokens those of the sequential run. A cut
        call (:class:`~swarm.diffusion.prediction.CutLogits`, ``expert_top_k`` > 0) composes over the union of the
        named ids (:func:`~swarm.diffusion.mixture.compose_union`)."""
        pending = self._take(states, context)
        answers = {}
        for name, job in pending.items():
            try:
                answers[name] = job.result()
            except ExpertUnavailable as error:
                self._drop(name, context.steps[0], error)
        if answers:
            logits = logits.clone()
        for row, step in enumerate(context.steps):
            start, end = context.block_of(row)
            composed = None
            if answers:
                mine = {name: answer_rows(answer, row, start - context.block_start, end - context.block_start)
                        for name, answer in answers.items()}
                composed = compose(read_block(logits, row, start, end), mine, self.weights, self.tau)
                write_block(logits, row, start, composed.log_probs)
            self._record(composed, states[row:row + 1, start:end] == self.mask_token_id, step)
        return logits

    def _take(self, states: torch.Tensor, context: DenoiseContext) -> dict[str, Pending]:
        started = self._pending.pop(id(context), None)
        if started is not None and started[0] is context:
            return started[1]
        # the hook ran without the wrapped denoiser (a caller's own sampler): query now
        return {name: self.sources[name].submit(states, context, self.top_k) for name in self.active()}

    def _drop(self, name: str, step: int, error: BaseException) -> None:
        self.dropped.add(name)
        message = f"expert {name!r} dropped at step {step}: {error}"
        self.warnings.append(message)
        logger.warning(message)

    # ----- telemetry --------------------------------------------------------------------------------
    def _record(self, composed: Optional[Composed], masked: torch.Tensor, step: int) -> None:
        """One row's telemetry (``masked``: its block's masked positions, shape (1, block))."""
        terms = {name: ExpertTerm(0.0, 0.0, False, 0.0, dropped=name in self.dropped) for name in self.weights}
        if composed is not None:
            terms.update(summarize(composed, self.weights, masked))
        entry = {name: term.to_dict() for name, term in terms.items()}
        if self._correcting:
            self.records.setdefault(step, {}).setdefault("corrector", []).append({"experts": entry})
        else:  # a Picard window may evaluate a step again from the exact state: the last one counts
            self.records[step] = {"experts": entry}

    @contextlib.contextmanager
    def correcting(self) -> Iterator[None]:
        """Evaluations inside are corrector steps: their telemetry goes to the step's ``corrector`` list."""
        self._correcting = True
        try:
            yield
        finally:
            self._correcting = False

    def note_correction(self, step: int, remasked: list[int], changed: list[int]) -> None:
        entries = self.records.setdefault(step, {}).setdefault("corrector", [])
        if not entries or "remasked" in entries[-1]:
            entries.append({})
        entries[-1].update(remasked=remasked, changed=changed)

    def telemetry(self, step: int) -> dict[str, Any]:
        """What happened at ``step``: ``experts`` (weight, norm, clipped...) and ``corrector`` (if any)."""
        return self.records.get(step, {})

    def info(self) -> dict[str, Any]:
        """The request's expert settings, for ``GenerationResult.info["experts"]``."""
        return {
            "weights": dict(self.weights), "tau": self.tau, "top_k": self.top_k,
            "corrector_steps": self.corrector_steps, "auto": self.auto, "dropped": sorted(self.dropped),
            "sources": {name: source.to_dict() for name, source in self.sources.items()},
        }
