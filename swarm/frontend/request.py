"""What one request asks for besides the sampler's settings (:class:`GenerationRequest`), declared like them.

A module of its own, importing no torch, so that the command line builds its options from the declarations
before loading anything heavy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from swarm.diffusion.config import (
    DEFAULT_EXPERT_TOP_K,
    DEFAULT_TAU,
    MAX_CORRECTOR_STEPS,
    MAX_EXPERT_TAU,
    MAX_EXPERT_TOP_K,
    check_experts,
    setting,
    settings_of,
)
from swarm.frontend.scale import SCALES
from swarm.governance.tiers import TIERS


@dataclass(frozen=True)
class GenerationRequest:
    """What one request asks for besides the sampler's settings: experts, safety tier, scale, prompt form, display.

    ``generate(prompt, **kwargs)`` splits its keyword arguments between this object and
    :class:`~swarm.diffusion.config.GenerationConfig` (:meth:`split`). Like the sampler's settings, each field is
    declared once, with its help text and bounds, and the command line, the HTTP API and the documentation
    test read the declaration. Checked by :meth:`check` (:meth:`BaseDiffusionLM.check_request` runs it).
    """

    experts: Optional[Union[dict[str, float], str]] = setting(
        None, 'Experts composed with the backbone at every step: {"code": 0.5} (at most 8, weights 0..10) or "auto" '
              "(chosen from the prompt); see docs/EXPERTS.md.")
    expert_tau: float = setting(DEFAULT_TAU, "Bound of each expert's shift of a token's log-probability, in nats.",
                                low=0.0, high=MAX_EXPERT_TAU, low_open=True)
    expert_top_k: int = setting(DEFAULT_EXPERT_TOP_K, "Tokens per position each expert answers, and the backbone's "
                                                      "scores are cut to (their most likely; the rest share what is "
                                                      "left evenly); 0: the whole vocabulary (exact, large answers, "
                                                      "the client's head). See docs/EXPERTS.md.",
                                low=0, high=MAX_EXPERT_TOP_K)
    corrector_steps: int = setting(0, "After each step, re-predict the least confident decided tokens this many "
                                      "times (one denoiser call each).", low=0, high=MAX_CORRECTOR_STEPS)
    tier: Optional[str] = setting(None, "A stricter safety tier than the prompt's own (see docs/GOVERNANCE.md).",
                                  choices=TIERS)
    scale: str = setting("auto", "How much of the swarm the request uses (see swarm/frontend/scale.py).",
                         choices=SCALES)
    chat: bool = setting(False, "Wrap the text prompt in the tokenizer's chat template (instruct checkpoints).",
                         api=False)  # the HTTP API has an endpoint for conversations
    progress: bool = setting(False, "Show a progress bar.", cli=False, api=False)  # the command shows every step
    adapter: Optional[str] = setting(
        None, "A fine-tuned adapter (a soft or deep prompt, a bottleneck, a LoRA): its directory, as written by "
              "python -m swarm.finetune, or the name it was published under (NAME, NAME@VERSION, NAME@AUTHOR@VERSION); "
              "see docs/TRAINING.md. Through a swarm, best:TASK picks the published adapter version with the best "
              "score on TASK by a trusted auditor, moving only by a margin (docs/AUDIT.md).",
        api=False)  # a path names a file of the API's host: not for remote callers

    @classmethod
    def split(cls, kwargs: Mapping[str, Any]) -> tuple["GenerationRequest", dict[str, Any]]:
        """This request's options out of ``generate``'s keyword arguments, and the sampler's settings left."""
        names = {declared.name for declared in settings_of(cls)}
        return (cls(**{key: value for key, value in kwargs.items() if key in names}),
                {key: value for key, value in kwargs.items() if key not in names})

    def check(self) -> int:
        """Check each option against its declaration; returns how many given experts compute (weight above 0)."""
        for declared in settings_of(GenerationRequest):
            declared.check(getattr(self, declared.name), self)
        return check_experts(self.experts)
