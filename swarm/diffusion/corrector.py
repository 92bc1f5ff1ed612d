"""Predictor-corrector sampling: after each step, remask the least confident decided tokens and predict again.

Confidences are those the tokens had when they were decided, because a masked-diffusion model is trained to
score masked positions only: its output at a visible position says nothing about that token.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Optional, Protocol, Sequence

import torch

from swarm.diffusion.config import GenerationConfig
from swarm.diffusion.denoiser import AnyDenoiser
from swarm.diffusion.sampler import DiffusionSampler, LogitsHook


class CorrectionLog(Protocol):
    """Where corrector steps are reported (the expert composition's telemetry)."""

    def correcting(self) -> ContextManager[None]:
        """Evaluations inside are corrector steps."""
        ...

    def note_correction(self, step: int, remasked: list[int], changed: list[int]) -> None:
        ...


def corrector_seed(seed: int, corrector: int) -> int:
    """The seed whose step noise corrector ``corrector`` draws its tokens with: a stream of its own, still a
    function of the generation's seed only, and a seed a head server draws with as the sampler does
    (:class:`~swarm.diffusion.prediction.HeadQuery`)."""
    return (seed + (corrector + 1) * 2**32) % 2**62


class CorrectorSampler(DiffusionSampler):
    """After each predictor step, ``corrector_steps`` times: remask the decided tokens of the block with the
    lowest confidence (as many as the step decided) and predict them again from one more denoiser call.

    Each token's confidence is the composed probability it had when it was (re)decided. Ties go to the
    earlier position and the corrector's noise has its own seeded stream, so the trajectory stays a
    deterministic function of the seed. Requires ``parallel_window=1`` (checked by the composition).
    """

    def __init__(self, denoiser: AnyDenoiser, config: GenerationConfig, mask_token_id: int,
                 eos_token_ids: Sequence[int] = (),
                 logits_hook: Optional[LogitsHook] = None, backbone_top_k: int = 0,
                 *, corrector_steps: int, composition: Optional[CorrectionLog] = None):
        super().__init__(denoiser, config, mask_token_id, eos_token_ids, logits_hook, backbone_top_k)
        self.corrector_steps = corrector_steps
        self.composition = composition
        self.confidence = torch.zeros(0, dtype=torch.float64)

    def initial_state(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        x = super().initial_state(prompt_ids)
        self.confidence = torch.zeros(len(x), dtype=torch.float64)
        return x

    def unmask(self, x: torch.Tensor, prediction: torch.Tensor, start: int, end: int,
               step: int) -> tuple[torch.Tensor, list[int]]:
        """The predictor's step, then ``corrector_steps`` corrections of the block."""
        nxt, filled = super().unmask(x, prediction, start, end, step)
        if not filled:
            return nxt, filled
        self._remember(prediction, filled, start)
        for corrector in range(self.corrector_steps):
            nxt = self._correct(nxt, start, end, step, corrector, count=len(filled))
        return nxt, filled

    def _remember(self, prediction: torch.Tensor, positions: list[int], start: int) -> None:
        """Each (re)decided position's confidence: the probability of the token it was given, which is the
        prediction row's token there (its ``probability`` column, wherever the prediction was computed)."""
        for position in positions:
            self.confidence[position] = prediction[position - start, 1]

    def _correct(self, x: torch.Tensor, start: int, end: int, step: int, corrector: int, count: int) -> torch.Tensor:
        decided = [p for p in range(start, end) if x[p] != self.mask_token_id]
        chosen = sorted(sorted(decided, key=lambda p: (float(self.confidence[p]), p))[:count])
        remasked = x.clone()
        remasked[chosen] = self.mask_token_id
        context = self.composition.correcting() if self.composition else contextlib.nullcontext()
        seed = corrector_seed(self.config.seed, corrector)
        with context:
            logits = self.evaluate(remasked[None], [step], noise_seed=seed)[0]
        prediction = self.block_prediction(logits, start, end, step, noise_seed=seed)
        out = remasked.clone()
        index = torch.tensor(chosen) - start
        out[chosen] = prediction[index, 0].long()
        self._remember(prediction, chosen, start)
        changed = [p for p in chosen if out[p] != x[p]]
        if self.composition is not None:
            self.composition.note_correction(step, chosen, changed)
        return out
