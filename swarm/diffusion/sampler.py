"""The masked-diffusion sampler: pure torch, no network.

A generation is a trajectory of states (token id sequences). Each step is a pure function
``next = transition(state, logits(state), step)``: the noise of step ``s`` comes from a generator seeded
by ``(seed, s)``, so the trajectory is a deterministic function of the seed. That makes the same sampler
exact over a local model, over remote spans, with Picard windows (several future states evaluated in
one batched denoiser call, then checked against the exact chain; ``parallel_window=1`` is the plain
sequential loop) and with draft-and-verify (``draft_steps``: future states drafted from the last verified
state's own logits, checked the same way).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch

from swarm.diffusion.config import GenerationConfig
from swarm.diffusion.denoiser import AnyDenoiser, DenoiseContext, Denoiser, Pending, pipelined
from swarm.diffusion.prediction import (
    MARGIN_COLUMN,
    BlockScores,
    CallLogits,
    HeadQuery,
    Predictions,
    StateScores,
    block_prediction,
    block_slice,
    cut_to_top_k,
    guided,
    masked_scores,
    predict_tokens,
    step_generator,
    step_uniform,
)
from swarm.diffusion.remasking import STRATEGIES
from swarm.utils.errors import EXIT_HALTED, SwarmError

__all__ = ["DenoiseContext", "Denoiser", "DiffusionSampler", "Halted", "LogitsHook", "SamplerStats", "StepEvent",
           "WindowStats", "predict_tokens", "step_generator"]  # re-exported from swarm.diffusion.denoiser, .prediction

logger = logging.getLogger(__name__)

LogitsHook = Callable[[CallLogits, torch.Tensor, DenoiseContext], CallLogits]
"""``hook(logits, tokens, context)``: rewrites a call's logits before a step uses them (expert composition)."""

Scores = StateScores
"""What a step decides from: one state's logits (length, vocab), its block cut, or a head server's predictions."""


@dataclass
class Evaluation:
    """A submitted denoiser call for a batch of states; its logits are collected when a step needs them."""

    states: torch.Tensor
    context: DenoiseContext
    pending: Pending
    logits: Optional[CallLogits | Predictions] = None


class Halted(SwarmError):
    """Raised by a denoiser to stop a generation cleanly before ``step`` (e.g. a governance halt).

    The generation front end turns it into a result whose ``finish_reason`` is ``"halted"``.
    """

    exit_code = EXIT_HALTED

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
    guessed: int = 0  # stale pipelining: steps decided on stale logits (checked unless stale_check is none)
    overturned: int = 0  # ... of which the step's own logits disagreed, so it was redone


@dataclass
class Guess:
    """A step decided on stale logits, held back until the logits of its own state confirm or overturn it."""

    step: int
    before: torch.Tensor
    after: torch.Tensor
    unmasked: list[int]


def num_transfer_schedule(masked: int, steps: int) -> list[int]:
    """Spread ``masked`` unmaskings over ``steps`` as evenly as possible, extra ones first (LLaDA)."""
    base, remainder = divmod(masked, steps)
    return [base + (1 if i < remainder else 0) for i in range(steps)]


class DiffusionSampler:
    """Runs LLaDA-style generation for one sequence over any :class:`Denoiser`."""

    def __init__(
        self,
        denoiser: AnyDenoiser,
        config: GenerationConfig,
        mask_token_id: int,
        eos_token_ids: Sequence[int] = (),
        logits_hook: Optional[LogitsHook] = None,
        backbone_top_k: int = 0,
    ):
        """``logits_hook(logits, tokens, context)`` may rewrite logits each step (expert composition); with
        ``backbone_top_k`` each state's block is first cut to its top k after guidance (experts composed with
        ``expert_top_k``: the cut a head server answers, :func:`~swarm.diffusion.prediction.cut_to_top_k`)."""
        self.denoiser = pipelined(denoiser)
        self.config = config
        self.mask_token_id = mask_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.logits_hook = logits_hook
        self.schedule = num_transfer_schedule(config.block_length, config.steps_per_block)
        self.stats = SamplerStats()
        self.prompt_length = 0
        # A head server may answer predictions instead of logits when nothing else reads the logits (no hook); a
        # stale step's are drawn there with its own step's noise (HeadQuery.ahead), a corrector's with its seed.
        self.accepts_predictions = logits_hook is None
        self.backbone_top_k = backbone_top_k
        # ... and its blocks cut to their top k when that is all the hook reads (experts; a stale step whose
        # source was cut to another block waits for its own, _covering_source).
        self.accepts_sparse = backbone_top_k > 0

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
    def decided_block(self, x: torch.Tensor) -> tuple[int, int]:
        """Bounds of the block a step from ``x`` decides: the active one (the last one once all are full)."""
        block = self.active_block(x)
        return self.block_bounds(block if block is not None else self.config.num_blocks - 1)

    def context(self, states: torch.Tensor, steps: Sequence[int],
                noise_seed: Optional[int] = None) -> DenoiseContext:
        blocks = tuple(self.decided_block(state) for state in states[:len(steps)])
        start, end = blocks[0]
        return DenoiseContext(tuple(steps), start, end, self.prompt_length,
                              self.head_query(states, steps, noise_seed), blocks if len(set(blocks)) > 1 else ())

    def head_query(self, states: torch.Tensor, steps: Sequence[int],
                   noise_seed: Optional[int] = None) -> Optional[HeadQuery]:
        """What a head server needs to predict these states' steps (with the noise of ``noise_seed``, default the
        generation's seed), or to cut their blocks to the top k (None when this sampler needs whole logits)."""
        if not (self.accepts_predictions or self.accepts_sparse):
            return None
        cfg = self.config
        seed = cfg.seed if noise_seed is None else noise_seed
        starts = tuple(self.decided_block(state)[0] for state in states)
        if not self.accepts_predictions:
            return HeadQuery(starts, cfg.block_length, tuple(steps), seed, cfg.temperature, cfg.cfg_scale,
                             self.mask_token_id, top_k=self.backbone_top_k)
        # A stale step decides on a state up to `staleness` steps old, with its own step's noise: drawn there too.
        ahead = cfg.staleness if cfg.temperature > 0 else 0
        return HeadQuery(starts, cfg.block_length, tuple(steps), seed, cfg.temperature, cfg.cfg_scale,
                         self.mask_token_id, ahead=ahead)

    def evaluate(self, states: torch.Tensor, steps: Sequence[int], noise_seed: Optional[int] = None) -> torch.Tensor:
        """Logits for a batch of states (one denoiser call), classifier-free guidance applied (or a head server's
        predictions, drawn with ``noise_seed``'s noise)."""
        return self.collect(self.submit(states, steps, noise_seed))

    def submit(self, states: torch.Tensor, steps: Sequence[int], noise_seed: Optional[int] = None) -> Evaluation:
        """Start one denoiser call (it runs at once unless the denoiser is pipelined: then in the background)."""
        context = self.context(states, steps, noise_seed)
        rows = states
        if self.config.cfg_scale > 0:
            unconditional = states.clone()
            unconditional[:, : self.prompt_length] = self.mask_token_id
            rows = torch.cat([states, unconditional])
        pending = self.denoiser.submit(rows, context)
        self.stats.denoiser_calls += 1
        self.stats.states_evaluated += len(states)
        return Evaluation(states, context, pending)

    def collect(self, evaluation: Evaluation) -> CallLogits | Predictions:
        """The call's logits with guidance and the logits hook applied (computed once per evaluation), or a head
        server's predictions (guidance applied there)."""
        if evaluation.logits is None:
            logits = evaluation.pending.result()
            if isinstance(logits, Predictions) and not logits.sparse:
                if not self.accepts_predictions:
                    raise RuntimeError("the denoiser answered predictions to a sampler that reads logits")
                evaluation.logits = logits
                self._report_margins(evaluation)
                return logits
            if isinstance(logits, Predictions):  # guided and cut on the head server
                if not self.accepts_sparse:
                    raise RuntimeError("the denoiser answered a cut to a sampler that reads whole logits")
                logits = logits.cut()
            else:
                logits = guided(logits, len(evaluation.states), self.config.cfg_scale)
                if self.backbone_top_k:
                    blocks = [evaluation.context.block_of(row) for row in range(len(evaluation.states))]
                    logits = cut_to_top_k(logits, blocks, self.backbone_top_k)
            if self.logits_hook is not None:
                logits = self.logits_hook(logits, evaluation.states, evaluation.context)
            evaluation.logits = logits
            self._report_margins(evaluation)
        return evaluation.logits

    def _report_margins(self, evaluation: Evaluation) -> None:
        """Tell the denoiser the first state's active-block margins, which the adaptive cache refresh compares
        (``cache_refresh_drift``; the margin does not depend on the step's noise)."""
        cfg = self.config
        if cfg.cache_refresh_drift is None or cfg.cache == "none":
            return
        context = evaluation.context
        prediction = self.block_prediction(evaluation.logits[0], context.block_start, context.block_end,
                                           context.steps[0])
        if prediction is not None:
            masked = evaluation.states[0, context.block_start:context.block_end] == self.mask_token_id
            self.denoiser.observe(evaluation.pending, prediction[:, MARGIN_COLUMN], masked)

    def block_scores(self, logits: Scores, start: int, end: int) -> BlockScores:
        """Float64 scores of the block's positions; a position is never "unmasked" to the mask token."""
        return masked_scores(block_slice(logits, start, end), self.mask_token_id)

    def block_prediction(self, scores: Scores, start: int, end: int, step: int,
                         noise_seed: Optional[int] = None) -> Optional[torch.Tensor]:
        """Prediction rows (:data:`~swarm.diffusion.prediction.PREDICTION_FIELDS`) of the block at ``step`` (with
        the noise of ``noise_seed``, default the generation's seed)."""
        cfg = self.config
        seed = cfg.seed if noise_seed is None else noise_seed
        return block_prediction(scores, start, end, step, cfg.temperature, seed, self.mask_token_id)

    def transition(self, x: torch.Tensor, scores: Scores, step: int) -> tuple[torch.Tensor, list[int]]:
        """The state after ``step``, from the state before it and that state's logits (length, vocab), its block cut
        to the named ids (experts at ``expert_top_k`` > 0), or a head server's predictions for it."""
        block = self.active_block(x)
        if block is None:
            return x, []
        start, end = self.block_bounds(block)
        prediction = self.block_prediction(scores, start, end, step)
        if prediction is None:  # predictions made for another block: only a guess's state can lead here
            return x, []
        return self.unmask(x, prediction, start, end, step)

    def unmask(self, x: torch.Tensor, prediction: torch.Tensor, start: int, end: int,
               step: int) -> tuple[torch.Tensor, list[int]]:
        """The state after ``step`` from the block ``start:end``'s prediction rows: the strategy's most confident
        masked positions (or those over the threshold) take their predicted tokens."""
        cfg = self.config
        x0 = prediction[:, 0].long()
        uniform = step_uniform(cfg.seed, step, end - start)
        masked = x[start:end] == self.mask_token_id
        confidence = STRATEGIES[cfg.remasking](prediction, uniform)
        confidence = torch.where(masked, confidence, torch.full_like(confidence, float("-inf")))
        order = torch.sort(confidence, descending=True, stable=True).indices
        if cfg.threshold is not None:
            chosen = masked & (prediction[:, 1] >= cfg.threshold)
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
        """Yield every step of the generation in order (Picard windows when ``parallel_window`` > 1,
        draft-and-verify when ``draft_steps`` > 0, stale pipelining when ``staleness`` > 0)."""
        if self.config.staleness > 0:
            yield from self._iterate_stale(prompt_ids)
        elif self.config.draft_steps > 0:
            yield from self._iterate_drafts(prompt_ids)
        else:
            yield from self._iterate_windows(prompt_ids)

    def _iterate_windows(self, prompt_ids: Sequence[int]) -> Iterator[StepEvent]:
        """Picard windows: the exact state and ``parallel_window`` - 1 guessed future states per call (1: the plain
        sequential loop); the guesses are the recomputed chain's tail."""
        x = self.initial_state(prompt_ids)
        step = 0
        guesses: list[torch.Tensor] = []
        window = self.config.parallel_window
        while not self.is_done(x):
            states = [x] + guesses[: window - 1]
            states += [states[-1]] * (window - len(states))
            logits = self.evaluate(torch.stack(states), [step + i for i in range(window)])
            chain, unmasked = self._recompute_chain(states, logits, step)
            accepted = self._accepted(states, chain)
            yield from self._accept(chain, unmasked, step, accepted, window)
            x, step = chain[accepted], step + accepted
            guesses = chain[accepted + 1:]

    def _iterate_drafts(self, prompt_ids: Sequence[int]) -> Iterator[StepEvent]:
        """Draft-and-verify (FreeDave's and SSD's lossless drafting): each call evaluates the exact state and up to
        ``draft_steps`` states drafted from it, the steps the sampler would take if the last verified state's own
        scores (the row of the exact state before it) did not change. Each row then gives the exact step from its
        own state, so the drafts are checked in order (:meth:`_accepted`): the longest prefix equal to the exact
        chain, plus the exact step after it, is accepted, and the row of the last accepted state is the source of
        the next drafts, at no extra call. Steps per call: 1 + accepted drafts.
        """
        x = self.initial_state(prompt_ids)
        step = 0
        source: Optional[Scores] = None  # the scores of the verified state just before x (None at the start)
        while not self.is_done(x):
            states = [x] + self._draft(x, source, step)
            logits = self.evaluate(torch.stack(states), [step + i for i in range(len(states))])
            chain, unmasked = self._recompute_chain(states, logits, step, tail=False)
            accepted = self._accepted(states, chain)
            yield from self._accept(chain, unmasked, step, accepted, len(states))
            x, step, source = chain[accepted], step + accepted, logits[accepted - 1]

    def _draft(self, x: torch.Tensor, source: Optional[Scores], step: int) -> list[torch.Tensor]:
        """Up to ``draft_steps`` states after ``x``: the sampler's own transitions, all from ``source``. Drafts stay
        in ``x``'s block and stop before a finished state (never evaluated by the exact run). A call scores only
        the rows its states read (:func:`~swarm.diffusion.pipeline.scored_rows`), so when ``x`` has just entered a
        block that ``source``'s call did not score, its drafts are worthless guesses (NaN scores), which the check
        rejects like any other wrong draft; a call of several states scores every later block, and drafts from it
        into the next block are often right."""
        drafts: list[torch.Tensor] = []
        if source is None:
            return drafts
        state, block = x, self.active_block(x)
        for i in range(self.config.draft_steps):
            if self.active_block(state) != block:
                break
            state, filled = self.transition(state, source, step + i)
            if not filled or self.is_done(state):
                break
            drafts.append(state)
        return drafts

    def _accepted(self, states: list[torch.Tensor], chain: list[torch.Tensor]) -> int:
        """How many steps of the recomputed chain are exact: the first always (its state is exact), then one more
        for each evaluated state equal to its exact step, never past a finished state."""
        accepted = 1  # chain[1] came from the exact state states[0] and its own logits
        while (accepted < len(states) and torch.equal(states[accepted], chain[accepted])
               and not self.is_done(chain[accepted])):
            accepted += 1
        return accepted

    def _accept(self, chain: list[torch.Tensor], unmasked: list[list[int]], step: int, accepted: int,
                evaluated: int) -> Iterator[StepEvent]:
        """Record one call's statistics and yield its accepted steps."""
        self.stats.windows.append(WindowStats(step, evaluated, accepted))
        for i in range(1, accepted + 1):
            yield self._event(chain[i], step + i - 1, unmasked[i - 1])

    def _iterate_stale(self, prompt_ids: Sequence[int]) -> Iterator[StepEvent]:
        """Stale pipelining: step t submits its state and decides on the logits of step t - s.

        Up to s + 1 calls are in flight, so s + 1 round trips overlap. A step decided on stale logits is a
        :class:`Guess`; when its own state's logits arrive (s steps later, when they become the source of a
        later step) ``stale_check`` confirms it or overturns it: the step is then redone from its own logits
        and every guess after it is dropped, as a Picard window drops a wrong tail. Steps are yielded only
        once confirmed. Which logits a step uses and when it is checked are fixed (never "whichever arrived
        first"), so the trajectory is a deterministic function of the seed, the same locally and through the
        swarm. Cache fills need no waiting: reuses name the fill version they read (:mod:`swarm.diffusion.pipeline`).
        """
        x = self.initial_state(prompt_ids)
        step, source = 0, 0
        in_flight: dict[int, Evaluation] = {}
        guesses: list[Guess] = []
        try:
            while True:
                done = self.is_done(x)
                if done and not guesses:
                    return
                if done:  # nothing left to decide: check the last guesses
                    source = guesses[-1].step
                else:
                    in_flight[step] = self.submit(x[None], [step])
                    source = max(step - self.config.staleness, source)  # never older than logits already used
                    source = self._covering_source(x, source, step, in_flight)
                confirmed, redone = self._check_guesses(guesses, source, in_flight)
                for guess in confirmed + ([redone] if redone else []):
                    yield self._event(guess.after, guess.step, guess.unmasked)
                if redone is not None:  # the guesses after it were built on a wrong state: drop their calls
                    for later in [s for s in in_flight if s > redone.step]:
                        in_flight.pop(later).pending.cancel()
                    x, step, source = redone.after, redone.step + 1, redone.step
                    continue
                if done:
                    continue
                logits = self.collect(in_flight[source])[0]
                for old in [s for s in in_flight if s < source]:  # never needed again: stop waiting for them
                    in_flight.pop(old).pending.cancel()
                nxt, unmasked = self.transition(x, logits, step)
                self.stats.guessed += source < step
                if source < step and self.config.stale_check != "none":
                    guesses.append(Guess(step, x, nxt, unmasked))
                else:
                    self.stats.windows.append(WindowStats(step, 1, 1))
                    yield self._event(nxt, step, unmasked)
                x, step = nxt, step + 1
        finally:
            for evaluation in in_flight.values():
                evaluation.pending.cancel()

    def _covering_source(self, x: torch.Tensor, source: int, step: int, in_flight: dict[int, Evaluation]) -> int:
        """``source``, unless its state was deciding another block than ``x``: then the first step of ``x``'s block
        waits for its own logits. A call cut to its state's block (experts at ``expert_top_k`` > 0) or answered as
        a head server's predictions knows no other block; whole logits do, and wait the same, so that every form
        of the scores gives the same tokens (locally and through the swarm)."""
        if source == step or self.decided_block(in_flight[source].states[0]) == self.decided_block(x):
            return source
        return step

    def _check_guesses(self, guesses: list[Guess], upto: int,
                       in_flight: dict[int, Evaluation]) -> tuple[list[Guess], Optional[Guess]]:
        """Check, in order, the guesses of steps <= ``upto`` against their own logits (removing them).

        Returns the confirmed ones and, at the first disagreement, the step redone from its own logits (the
        remaining guesses are then dropped).
        """
        confirmed: list[Guess] = []
        while guesses and guesses[0].step <= upto:
            guess = guesses.pop(0)
            own = self.collect(in_flight[guess.step])[0]
            self.stats.windows.append(WindowStats(guess.step, 1, 1))
            if self.config.stale_check == "token" and self._predicts(own, guess):
                confirmed.append(guess)
                continue
            after, unmasked = self.transition(guess.before, own, guess.step)
            if self.config.stale_check == "exact" and torch.equal(after, guess.after):
                confirmed.append(guess)
                continue
            self.stats.overturned += 1
            guesses.clear()
            return confirmed, Guess(guess.step, guess.before, after, unmasked)
        return confirmed, None

    def _predicts(self, logits: torch.Tensor, guess: Guess) -> bool:
        """Whether ``logits`` (of the guess's own state) predict every token the guess unmasked."""
        start, end = self.block_bounds(self.active_block(guess.before))
        predicted = self.block_prediction(logits, start, end, guess.step)[:, 0].long()  # the step's own noise
        positions = torch.tensor(guess.unmasked)
        return torch.equal(predicted[positions - start], guess.after[positions])

    def _recompute_chain(
        self, states: list[torch.Tensor], logits: torch.Tensor | Predictions, step: int, tail: bool = True
    ) -> tuple[list[torch.Tensor], list[list[int]]]:
        """Apply the transitions in sequence, each with the logits evaluated at the guessed state.

        ``chain[i+1]`` is exact whenever ``chain[i]`` is exact and equals the guess ``states[i]``.
        With ``tail``, the chain goes on beyond the evaluated states with the last logits: a Picard window's
        cheap guesses for the next window.
        """
        chain, unmasked = [states[0]], []
        for i in range(len(states)):
            nxt, filled = self.transition(chain[-1], logits[i], step + i)
            chain.append(nxt)
            unmasked.append(filled)
        for i in range(len(states), 2 * len(states) - 1 if tail else len(states)):
            chain.append(self.transition(chain[-1], logits[-1], step + i)[0])
        return chain, unmasked

    def _event(self, x: torch.Tensor, step: int, unmasked: list[int]) -> StepEvent:
        left = int((x[self.prompt_length:] == self.mask_token_id).sum())
        block = (unmasked[0] - self.prompt_length) // self.config.block_length  # every step fills >= 1
        return StepEvent(step=step, block=block, tokens=x, unmasked=unmasked, masked_left=left)
