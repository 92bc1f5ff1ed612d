"""Composing a backbone with experts at every denoising step: pure torch, no network.

For the positions of the block being decided, each step uses

    log p = log_softmax( log p_b + sum_e w_e * clip_tau(log p_e - log p_b) )

a geometric mixture relative to the backbone: an expert moves the backbone's log-probabilities towards
its own, by its weight ``w_e >= 0``, and by at most ``w_e * tau`` nats per token, so that one expert that is
certain a token is impossible (or certain) cannot veto the rest on its own. ``w_e = 0`` leaves the backbone
untouched (the expert is not even queried); with one expert, ``w_e = 1`` and no clipping the result is that
expert alone. Weights always come from the caller or the prompt classifier (:func:`auto_experts`):
uniform averaging is never a default.

Optional predictor-corrector steps (:class:`CorrectorSampler`) remask the lowest-confidence decided tokens
of the current block and predict them again under the composed distribution. Confidences are those the
tokens had when they were decided, because a masked-diffusion model is trained to score masked positions
only: its output at a visible position says nothing about that token.
"""
from __future__ import annotations

import contextlib
import logging
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, Sequence

import torch

from swarm.diffusion.config import GenerationConfig
from swarm.diffusion.sampler import (DenoiseContext, Denoiser, DiffusionSampler, Ready, predict_tokens,
                                    step_generator)

logger = logging.getLogger(__name__)

DEFAULT_TAU = 10.0
MAX_PENDING_CALLS = 16  # expert queries kept for calls in flight; older ones belong to dropped calls


class IncompatibleExpertError(ValueError):
    """An expert that does not share the backbone's tokenizer, vocabulary or mask token."""


class ExpertNotFoundError(LookupError):
    """An expert asked for by name that is neither loadable here nor announced in the swarm."""


class ExpertUnavailable(RuntimeError):
    """An expert that can no longer answer (every server hosting it failed): it is dropped, with a warning."""


# ----- compatibility --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CompatibilityTag:
    """What two models must share for their per-token log-probabilities to be comparable."""

    tokenizer: str  # the tokenizer's fingerprint
    vocab_size: int
    mask_token_id: int

    @classmethod
    def of(cls, config: Any, tokenizer: Any) -> "CompatibilityTag":
        """The tag of a model from its config (vocab size, mask id) and its tokenizer."""
        return cls(tokenizer.fingerprint(), int(config.vocab_size), int(config.mask_token_id))

    def to_value(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer, "vocab_size": self.vocab_size, "mask_token_id": self.mask_token_id}

    @classmethod
    def from_value(cls, value: Any) -> "CompatibilityTag":
        """Raises ValueError/TypeError/KeyError on anything malformed (callers treat it as a bad record)."""
        return cls(str(value["tokenizer"]), int(value["vocab_size"]), int(value["mask_token_id"]))

    def mismatches(self, other: "CompatibilityTag") -> list[str]:
        """Human-readable differences, empty when compatible."""
        return [f"{name} {getattr(other, name)!r} (backbone: {getattr(self, name)!r})"
                for name in ("tokenizer", "vocab_size", "mask_token_id") if getattr(self, name) != getattr(other, name)]

    def require_compatible(self, other: "CompatibilityTag", expert: str) -> None:
        problems = self.mismatches(other)
        if problems:
            raise IncompatibleExpertError(f"expert {expert!r} is incompatible with the backbone: {'; '.join(problems)}")


# ----- the closed form ------------------------------------------------------------------------------------
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
    base_logits: torch.Tensor, expert_log_probs: Mapping[str, torch.Tensor], weights: Mapping[str, float],
    tau: float = DEFAULT_TAU,
) -> Composed:
    """``log_softmax(log p_b + sum_e w_e clip_tau(log p_e - log p_b))`` over the last dimension.

    Inputs may be logits or log-probabilities (both are normalised first); computed in float32.
    """
    base = torch.log_softmax(base_logits.float(), dim=-1)
    total = base.clone()
    contributions, clipped = {}, {}
    for name, log_probs in expert_log_probs.items():
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


# ----- where expert predictions come from -----------------------------------------------------------------
class PendingLogProbs(Protocol):
    def result(self) -> torch.Tensor:
        """Log-probabilities (batch, block_end - block_start, vocab); raises ExpertUnavailable when none come."""
        ...


class ExpertSource(Protocol):
    def submit(self, tokens: torch.Tensor, context: DenoiseContext) -> PendingLogProbs:
        """Start scoring the block ``context.block_start:block_end`` of each row of ``tokens`` (batch, length)."""
        ...

    def describe(self) -> dict[str, Any]:
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

    def submit(self, tokens: torch.Tensor, context: DenoiseContext) -> Ready:
        return Ready(block_log_probs(self.logits(tokens), context.block_start, context.block_end))

    def describe(self) -> dict[str, Any]:
        return {"model": self.label}


# ----- choosing experts from the prompt -------------------------------------------------------------------
ARITHMETIC = re.compile(r"\d+\s*[-+*/x×]\s*\d+")
PYTHON = re.compile(
    r"^\s*(def\s+\w+\s*\(|class\s+\w+\s*[:(]|import\s+\w|from\s+[\w.]+\s+import\b|return\b|"
    r"(if|elif|for|while|with|try|except)\b.*:\s*$)|\bprint\(|\bself\.",
    re.MULTILINE,
)
AUTO_RULES: tuple[tuple[str, re.Pattern, float], ...] = (
    ("addition", ARITHMETIC, 1.0),  # a narrow task expert: let it lead (clipping still bounds it)
    ("code", PYTHON, 0.5),  # a style/domain expert: nudge the backbone
)


def auto_experts(prompt: str) -> dict[str, float]:
    """Experts and weights for ``experts="auto"``: every rule of :data:`AUTO_RULES` whose pattern occurs.

    An arithmetic pattern (``12+34``, ``3 * 4``) selects ``addition`` at weight 1.0; Python syntax (a line
    starting ``def f(``, ``class C:``, ``import x``, ``from x import``, ``return``, a compound statement
    ending in ``:``, or ``print(`` / ``self.`` anywhere) selects ``code`` at 0.5. No match: no expert.
    """
    return {name: weight for name, pattern, weight in AUTO_RULES if pattern.search(prompt)}


def expert_weights(experts: Any, prompt: str) -> tuple[dict[str, float], bool]:
    """Resolve the ``experts`` argument: ``None``, ``"auto"`` or ``{name: weight}``; says whether it was auto."""
    if experts is None:
        return {}, False
    if isinstance(experts, str):
        if experts != "auto":
            raise ValueError(f"experts must be 'auto' or a mapping of name to weight, got {experts!r}")
        return auto_experts(prompt), True
    return validate_weights(experts), False


# ----- one generation -------------------------------------------------------------------------------------
class Composition:
    """Experts and correctors for one generation: the sampler's logits hook, its sampler, and its telemetry.

    :meth:`wrap` starts the expert queries of a step before the backbone's call, so that remote experts
    compute while the backbone does; :meth:`hook` collects them and composes. Zero-weight experts are not
    queried. An expert that fails for good is dropped for the rest of the generation, with a warning.
    """

    def __init__(
        self, sources: Mapping[str, ExpertSource], weights: Mapping[str, float], generation: GenerationConfig,
        mask_token_id: int, *, tau: float = DEFAULT_TAU, corrector_steps: int = 0, warnings: Sequence[str] = (),
        auto: bool = False,
    ):
        self.weights = validate_weights(weights)
        missing = set(self.weights) - set(sources)
        if missing:
            raise ValueError(f"no source for experts {sorted(missing)}")
        self.sources = dict(sources)
        self.tau = validate_tau(tau)
        if isinstance(corrector_steps, bool) or not isinstance(corrector_steps, int) or corrector_steps < 0:
            raise ValueError(f"corrector_steps must be an integer >= 0, got {corrector_steps!r}")
        if corrector_steps and (generation.parallel_window != 1 or generation.staleness):
            raise ValueError("corrector_steps need parallel_window=1 and staleness=0: a corrected step makes "
                             "denoiser calls of its own, while Picard windows and stale pipelining assume one "
                             "call per step")
        self.generation = generation
        self.mask_token_id = mask_token_id
        self.corrector_steps = corrector_steps
        self.auto = auto
        self.warnings = list(warnings)
        self.dropped: set[str] = set()
        self.records: dict[int, dict[str, Any]] = {}
        # Expert queries started with each backbone call, by call (stale pipelining keeps several in flight).
        self._pending: OrderedDict[int, tuple[DenoiseContext, dict[str, PendingLogProbs]]] = OrderedDict()
        self._correcting = False

    def active(self) -> list[str]:
        """Experts queried this step: positive weight, not dropped."""
        return [name for name, weight in self.weights.items() if weight > 0 and name not in self.dropped]

    # ----- sampler plumbing ---------------------------------------------------------------------------
    def sampler(self, denoiser: Denoiser, eos_token_ids: Sequence[int] = ()) -> DiffusionSampler:
        hook = self.hook if self.weights else None
        if self.corrector_steps:
            return CorrectorSampler(self.wrap(denoiser), self.generation, self.mask_token_id, eos_token_ids, hook,
                                    corrector_steps=self.corrector_steps, composition=self)
        return DiffusionSampler(self.wrap(denoiser), self.generation, self.mask_token_id, eos_token_ids, hook)

    def wrap(self, denoiser: Denoiser) -> "ExpertsFirst":
        """The backbone's denoiser, each call preceded by starting its expert queries."""
        return ExpertsFirst(self, denoiser)

    def start_queries(self, tokens: torch.Tensor, context: DenoiseContext) -> None:
        """Query the active experts on the call's conditional rows (guidance appends unconditional copies)."""
        names = self.active()
        if names:
            rows = tokens[: len(context.steps)]
            self._pending[id(context)] = (context, {name: self.sources[name].submit(rows, context) for name in names})
            while len(self._pending) > MAX_PENDING_CALLS:  # calls dropped uncollected (overturned guesses)
                self._pending.popitem(last=False)

    def hook(self, logits: torch.Tensor, states: torch.Tensor, context: DenoiseContext) -> torch.Tensor:
        """Compose the block's logits with every active expert's log-probabilities; record telemetry."""
        pending = self._take(states, context)
        answers = {}
        for name, job in pending.items():
            try:
                answers[name] = job.result()
            except ExpertUnavailable as error:
                self._drop(name, context.steps[0], error)
        start, end = context.block_start, context.block_end
        composed = None
        if answers:
            composed = compose(logits[:, start:end], answers, self.weights, self.tau)
            logits = logits.clone()
            logits[:, start:end] = composed.log_probs.to(logits.dtype)
        self._record(composed, states[:, start:end] == self.mask_token_id, context)
        return logits

    def _take(self, states: torch.Tensor, context: DenoiseContext) -> dict[str, PendingLogProbs]:
        started = self._pending.pop(id(context), None)
        if started is not None and started[0] is context:
            return started[1]
        # the hook ran without the wrapped denoiser (a caller's own sampler): query now
        return {name: self.sources[name].submit(states, context) for name in self.active()}

    def _drop(self, name: str, step: int, error: BaseException) -> None:
        self.dropped.add(name)
        message = f"expert {name!r} dropped at step {step}: {error}"
        self.warnings.append(message)
        logger.warning(message)

    # ----- telemetry --------------------------------------------------------------------------------
    def _record(self, composed: Optional[Composed], masked: torch.Tensor, context: DenoiseContext) -> None:
        for row, step in enumerate(context.steps):
            terms = {name: ExpertTerm(0.0, 0.0, False, 0.0, dropped=name in self.dropped) for name in self.weights}
            if composed is not None:
                where = torch.zeros_like(masked)
                where[row] = masked[row]
                terms.update(summarize(composed, self.weights, where))
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
            "weights": dict(self.weights), "tau": self.tau, "corrector_steps": self.corrector_steps,
            "auto": self.auto, "dropped": sorted(self.dropped),
            "sources": {name: source.describe() for name, source in self.sources.items()},
        }


class ExpertsFirst:
    """A denoiser that starts a call's expert queries, then the backbone's call; in flight together when the
    backbone's denoiser can ``submit`` (stale pipelining), so experts are pipelined with it."""

    def __init__(self, composition: Composition, denoiser: Denoiser):
        self.composition, self.denoiser = composition, denoiser

    def __call__(self, tokens: torch.Tensor, context: DenoiseContext) -> torch.Tensor:
        self.composition.start_queries(tokens, context)
        return self.denoiser(tokens, context)

    def submit(self, tokens: torch.Tensor, context: DenoiseContext) -> Any:
        self.composition.start_queries(tokens, context)
        submit = getattr(self.denoiser, "submit", None)
        return submit(tokens, context) if submit is not None else Ready(self.denoiser(tokens, context))


# ----- predictor-corrector --------------------------------------------------------------------------------
def corrector_generator(seed: int, step: int, corrector: int) -> torch.Generator:
    """Noise of corrector ``corrector`` of ``step``: a stream of its own, still a function of the seed only."""
    return step_generator(seed + (corrector + 1) * 2**32, step)


def decided_scores(logits: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """Float64 scores of one block's positions with the mask token excluded, as the sampler ranks them."""
    scores = logits.double()
    scores[:, mask_token_id] = float("-inf")
    return scores


class CorrectorSampler(DiffusionSampler):
    """After each predictor step, ``corrector_steps`` times: remask the decided tokens of the block with the
    lowest confidence (as many as the step decided) and predict them again from one more denoiser call.

    Each token's confidence is the composed probability it had when it was (re)decided. Ties go to the
    earlier position and the corrector's noise has its own seeded stream, so the trajectory stays a
    deterministic function of the seed. Requires ``parallel_window=1`` (checked by :class:`Composition`).
    """

    def __init__(self, denoiser: Denoiser, config: GenerationConfig, mask_token_id: int,
                 eos_token_ids: Sequence[int] = (), logits_hook=None, *, corrector_steps: int,
                 composition: Optional[Composition] = None):
        super().__init__(denoiser, config, mask_token_id, eos_token_ids, logits_hook)
        self.corrector_steps = corrector_steps
        self.composition = composition
        self.confidence = torch.zeros(0, dtype=torch.float64)

    def initial_state(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        x = super().initial_state(prompt_ids)
        self.confidence = torch.zeros(len(x), dtype=torch.float64)
        return x

    def transition(self, x: torch.Tensor, logits: torch.Tensor, step: int) -> tuple[torch.Tensor, list[int]]:
        block = self.active_block(x)
        nxt, filled = super().transition(x, logits, step)
        if block is None or not filled:
            return nxt, filled
        start, end = self.block_bounds(block)
        self._remember(nxt, decided_scores(logits[start:end], self.mask_token_id), filled, start)
        for corrector in range(self.corrector_steps):
            nxt = self._correct(nxt, start, end, step, corrector, count=len(filled))
        return nxt, filled

    def _remember(self, x: torch.Tensor, scores: torch.Tensor, positions: list[int], start: int) -> None:
        probs = torch.softmax(scores, dim=-1)
        for position in positions:
            self.confidence[position] = probs[position - start, x[position]]

    def _correct(self, x: torch.Tensor, start: int, end: int, step: int, corrector: int, count: int) -> torch.Tensor:
        decided = [p for p in range(start, end) if x[p] != self.mask_token_id]
        chosen = sorted(sorted(decided, key=lambda p: (float(self.confidence[p]), p))[:count])
        remasked = x.clone()
        remasked[chosen] = self.mask_token_id
        context = self.composition.correcting() if self.composition else contextlib.nullcontext()
        with context:
            logits = self.evaluate(remasked[None], [step])[0]
        scores = decided_scores(logits[start:end], self.mask_token_id)
        generator = corrector_generator(self.config.seed, step, corrector)
        predictions = predict_tokens(scores, self.config.temperature, generator)
        out = remasked.clone()
        index = torch.tensor(chosen) - start
        out[chosen] = predictions[index]
        self._remember(out, scores, chosen, start)
        changed = [p for p in chosen if out[p] != x[p]]
        if self.composition is not None:
            self.composition.note_correction(step, chosen, changed)
        return out
