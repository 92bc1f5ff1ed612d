"""The masked-diffusion sampler: pure torch, no network.

A generation is a trajectory of states (token id sequences). Each step is a pure function
``next = transition(state, logits(state), step)``: the noise of step ``s`` comes from a generator seeded
by ``(seed, s)``, so the trajectory is a deterministic function of the seed. That makes the same sampler
exact over a local model, over remote spans, and with Picard windows (several future states evaluated in
one batched denoiser call, then checked against the exact chain; ``parallel_window=1`` is the plain
sequential loop).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import torch

from swarm.diffusion.config import GenerationConfig
from swarm.diffusion.remasking import STRATEGIES, low_confidence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DenoiseContext:
    """What the denoiser may want to know about the rows it scores (caching layers use it)."""

    steps: tuple[int, ...]
    block_start: int
    block_end: int
    prompt_length: int


class Denoiser(Protocol):
    def __call__(self, tokens: torch.Tensor, context: DenoiseContext) -> torch.Tensor:
        """tokens (batch, length) int64 -> logits (batch, length, vocab), position i scoring token i."""
        ...


@dataclass
class Ready:
    """An already computed answer, for work done in-process (the pending-result interface)."""

    value: torch.Tensor

    def result(self) -> torch.Tensor:
        return self.value

    def cancel(self) -> None:
        """Nothing to stop: the work is done."""


@dataclass
class Evaluation:
    """A submitted denoiser call for a batch of states; its logits are collected when a step needs them."""

    states: torch.Tensor
    context: DenoiseContext
    pending: Any  # has result() and cancel(); a ``barrier`` attribute marks calls later ones depend on
    logits: Optional[torch.Tensor] = None

    @property
    def barrier(self) -> bool:
        return bool(getattr(self.pending, "barrier", False))


class Halted(Exception):
    """Raised by a denoiser to stop a generation cleanly before ``step`` (e.g. a governance halt).

    The generation front end turns it into a result whose ``finish_reason`` is ``"halted"``.
    """

    def __init__(self, step: int, reason: str, details: Optional[dict] = None):
        self.step, self.reason, self.details = step, reason, details or {}
        super().__init__(f"halted before step {step}: {reason}")


@dataclass
class StepEvent:
    """One accepted step of the trajectory."""

    step: int
    block: int
    tokens: torch.Tensor  # (length,) the state after this step
    unmasked: list[int]  # absolute positions filled by this step
    masked_left: int
    telemetry: dict = field(default_factory=dict)


@dataclass
class WindowStats:
    """One batched denoiser call of a Picard window: how many states it evaluated and accepted."""

    first_step: int
    evaluated: int
    accepted: int


@dataclass
class SamplerStats:
    denoiser_calls: int = 0  # sequential round trips: one per batched call
    states_evaluated: int = 0  # rows scored (excluding the CFG copies)
    windows: list[WindowStats] = field(default_factory=list)


def num_transfer_schedule(masked: int, steps: int) -> list[int]:
    """Spread ``masked`` unmaskings over ``steps`` as evenly as possible, extra ones first (LLaDA)."""
    base, remainder = divmod(masked, steps)
    return [base + (1 if i < remainder else 0) for i in range(steps)]


def step_generator(seed: int, step: int) -> torch.Generator:
    """A generator whose stream depends only on (seed, step)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


class DiffusionSampler:
    """Runs LLaDA-style generation for one sequence over any :class:`Denoiser`."""

    def __init__(
        self,
        denoiser: Denoiser,
        config: GenerationConfig,
        mask_token_id: int,
        eos_token_ids: Sequence[int] = (),
        logits_hook: Optional[Callable[[torch.Tensor, torch.Tensor, DenoiseContext], torch.Tensor]] = None,
    ):
        """``logits_hook(logits, tokens, context)`` may rewrite logits each step (expert composition)."""
        self.denoiser = denoiser
        self.config = config
        self.mask_token_id = mask_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.logits_hook = logits_hook
        self.schedule = num_transfer_schedule(config.block_length, config.steps_per_block)
        self.stats = SamplerStats()
        self.prompt_length = 0

    # ----- states -------------------------------------------------------------------------------
    def initial_state(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        if len(prompt_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        self.prompt_length = len(prompt_ids)
        x = torch.full((len(prompt_ids) + self.config.gen_length,), self.mask_token_id, dtype=torch.long)
        x[: len(prompt_ids)] = torch.as_tensor(list(prompt_ids), dtype=torch.long)
        return x

    def block_bounds(self, block: int) -> tuple[int, int]:
        start = self.prompt_length + block * self.config.block_length
        return start, start + self.config.block_length

    def active_block(self, x: torch.Tensor) -> Optional[int]:
        """The first block that still has masks (blocks fill left to right), or None."""
        masked = (x[self.prompt_length:] == self.mask_token_id).nonzero()
        return None if len(masked) == 0 else int(masked[0]) // self.config.block_length

    def is_done(self, x: torch.Tensor) -> bool:
        block = self.active_block(x)
        if block is None:
            return True
        if self.config.stop_at_eos and self.eos_token_ids and block > 0:
            finished = x[self.prompt_length: self.block_bounds(block)[0]]
            return bool(torch.isin(finished, torch.tensor(self.eos_token_ids)).any())
        return False

    # ----- one step -----------------------------------------------------------------------------
    def context(self, x: torch.Tensor, steps: Sequence[int]) -> DenoiseContext:
        block = self.active_block(x)
        start, end = self.block_bounds(block if block is not None else self.config.num_blocks - 1)
        return DenoiseContext(tuple(steps), start, end, self.prompt_length)

    def evaluate(self, states: torch.Tensor, steps: Sequence[int]) -> torch.Tensor:
        """Logits for a batch of states (one denoiser call), classifier-free guidance applied."""
        return self.collect(self.submit(states, steps))

    def submit(self, states: torch.Tensor, steps: Sequence[int]) -> Evaluation:
        """Start one denoiser call (at once, unless the denoiser offers ``submit`` to run it in the background)."""
        context = self.context(states[0], steps)
        rows = states
        if self.config.cfg_scale > 0:
            unconditional = states.clone()
            unconditional[:, : self.prompt_length] = self.mask_token_id
            rows = torch.cat([states, unconditional])
        submit = getattr(self.denoiser, "submit", None)
        pending = submit(rows, context) if submit is not None else Ready(self.denoiser(rows, context))
        self.stats.denoiser_calls += 1
        self.stats.states_evaluated += len(states)
        return Evaluation(states, context, pending)

    def collect(self, evaluation: Evaluation) -> torch.Tensor:
        """The call's logits with guidance and the logits hook applied (computed once per evaluation)."""
        if evaluation.logits is None:
            logits = evaluation.pending.result()
            states = evaluation.states
            if self.config.cfg_scale > 0:
                cond, uncond = logits[: len(states)], logits[len(states):]
                logits = uncond + (self.config.cfg_scale + 1) * (cond - uncond)
            if self.logits_hook is not None:
                logits = self.logits_hook(logits, states, evaluation.context)
            evaluation.logits = logits
        return evaluation.logits

    def block_scores(self, logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Float64 scores of the block's positions; a position is never "unmasked" to the mask token."""
        scores = logits[start:end].double()
        scores[:, self.mask_token_id] = float("-inf")
        return scores

    def transition(self, x: torch.Tensor, logits: torch.Tensor, step: int) -> tuple[torch.Tensor, list[int]]:
        """The state after ``step``, from the state before it and that state's logits (length, vocab)."""
        block = self.active_block(x)
        if block is None:
            return x, []
        cfg = self.config
        start, end = self.block_bounds(block)
        scores = self.block_scores(logits, start, end)
        generator = step_generator(cfg.seed, step)
        if cfg.temperature > 0:
            uniform_noise = torch.rand(scores.shape, generator=generator, dtype=torch.float64)
            gumbel = -torch.log(-torch.log(uniform_noise.clamp(1e-300, 1.0 - 1e-16)))
            x0 = (scores + cfg.temperature * gumbel).argmax(-1)
        else:
            x0 = scores.argmax(-1)
        uniform = torch.rand(end - start, generator=generator, dtype=torch.float64)
        probs = torch.softmax(scores, dim=-1)
        masked = x[start:end] == self.mask_token_id
        confidence = STRATEGIES[cfg.remasking](probs, x0, uniform)
        confidence = torch.where(masked, confidence, torch.full_like(confidence, float("-inf")))
        order = torch.sort(confidence, descending=True, stable=True).indices
        if cfg.threshold is not None:
            chosen = masked & (low_confidence(probs, x0, uniform) >= cfg.threshold)
            if not chosen.any():
                chosen[order[0]] = True
            picked = chosen.nonzero().flatten()
        else:
            wanted = self.schedule[step % cfg.steps_per_block]
            picked = order[: min(wanted, int(masked.sum()))]
        nxt = x.clone()
        nxt[start + picked] = x0[picked]
        return nxt, sorted(int(p) + start for p in picked)

    # ----- the trajectory -----------------------------------------------------------------------
    def iterate(self, prompt_ids: Sequence[int]) -> Iterator[StepEvent]:
        """Yield every step of the generation in order (Picard windows when ``parallel_window`` > 1, stale
        pipelining when ``staleness`` > 0)."""
        if self.config.staleness > 0:
            yield from self._iterate_stale(prompt_ids)
            return
        x = self.initial_state(prompt_ids)
        step = 0
        guesses: list[torch.Tensor] = []
        window = self.config.parallel_window
        while not self.is_done(x):
            states = [x] + guesses[: window - 1]
            states += [states[-1]] * (window - len(states))
            logits = self.evaluate(torch.stack(states), [step + i for i in range(window)])
            chain, unmasked = self._recompute_chain(states, logits, step)
            accepted = 1  # chain[1] came from the exact state x and its exact logits
            while (accepted < window and torch.equal(states[accepted], chain[accepted])
                   and not self.is_done(chain[accepted])):
                accepted += 1
            self.stats.windows.append(WindowStats(step, window, accepted))
            for i in range(1, accepted + 1):
                yield self._event(chain[i], step + i - 1, unmasked[i - 1])
            x, step = chain[accepted], step + accepted
            guesses = chain[accepted + 1:]

    def _iterate_stale(self, prompt_ids: Sequence[int]) -> Iterator[StepEvent]:
        """Stale pipelining: step t submits its state and moves on with the logits of step t - s.

        Up to s + 1 calls are in flight, so s + 1 round trips overlap. Which logits a step uses is fixed
        (never "whichever arrived first"), so the trajectory is still a deterministic function of the seed and
        the same locally and through the swarm. A barrier call (a cache fill) is waited for: later calls
        depend on the cache it builds, and steps never use logits older than it.
        """
        x = self.initial_state(prompt_ids)
        step, source = 0, 0
        in_flight: dict[int, Evaluation] = {}
        try:
            while not self.is_done(x):
                evaluation = in_flight[step] = self.submit(x[None], [step])
                # Never older than a barrier, nor than logits an earlier step already used.
                source = step if evaluation.barrier else max(step - self.config.staleness, source)
                logits = self.collect(in_flight[source])[0]
                while source < step and not self._safe_to_use_stale(x, logits, step):
                    source += 1  # not confident enough: wait for the next fresher call
                    logits = self.collect(in_flight[source])[0]
                for old in [s for s in in_flight if s < source]:  # never used again: stop waiting for them
                    in_flight.pop(old).pending.cancel()
                nxt, unmasked = self.transition(x, logits, step)
                self.stats.windows.append(WindowStats(step, 1, 1))
                yield self._event(nxt, step, unmasked)
                x, step = nxt, step + 1
        finally:
            for evaluation in in_flight.values():
                evaluation.pending.cancel()

    def _safe_to_use_stale(self, x: torch.Tensor, logits: torch.Tensor, step: int) -> bool:
        """Whether every position this step would unmask has probability >= ``stale_min_confidence``.

        Tokens decided since the logits were computed are invisible to them; a confident prediction rarely
        depends on them, a hesitant one often does.
        """
        nxt, picked = DiffusionSampler.transition(self, x, logits, step)  # the plain step: no corrector calls
        if not picked:
            return True
        start, end = self.block_bounds(self.active_block(x))
        probs = torch.softmax(self.block_scores(logits, start, end), dim=-1)
        rows = torch.tensor(picked) - start
        chosen = probs[rows, nxt[torch.tensor(picked)]]
        return bool((chosen >= self.config.stale_min_confidence).all())

    def _recompute_chain(
        self, states: list[torch.Tensor], logits: torch.Tensor, step: int
    ) -> tuple[list[torch.Tensor], list[list[int]]]:
        """Apply the transitions in sequence, each with the logits evaluated at the guessed state.

        ``chain[i+1]`` is exact whenever ``chain[i]`` is exact and equals the guess ``states[i]``.
        The tail beyond the window reuses the last logits: a cheap guess for the next window.
        """
        chain, unmasked = [states[0]], []
        for i in range(len(states)):
            nxt, filled = self.transition(chain[-1], logits[i], step + i)
            chain.append(nxt)
            unmasked.append(filled)
        for i in range(len(states), 2 * len(states) - 1):
            chain.append(self.transition(chain[-1], logits[-1], step + i)[0])
        return chain, unmasked

    def _event(self, x: torch.Tensor, step: int, unmasked: list[int]) -> StepEvent:
        left = int((x[self.prompt_length:] == self.mask_token_id).sum())
        block = (unmasked[0] - self.prompt_length) // self.config.block_length  # every step fills >= 1
        return StepEvent(step=step, block=block, tokens=x, unmasked=unmasked, masked_left=left)
