"""Settings of one generation, checked once, before any compute.

Every size-like or float setting a request can carry is bounded here, in one place:

* :class:`GenerationConfig` checks each setting on its own (types, finite floats, documented ranges);
* :class:`GenerationLimits` checks what follows from the model and the machine: the prompt plus
  ``gen_length`` within the model's positions, and the tokens one request's denoiser calls hold at once
  (Picard window x CFG rows x calls in flight x models, times the sequence) within a memory budget;
* :func:`check_experts` checks the experts and their weights (``expert_tau`` and ``corrector_steps`` are
  declared settings of the request, checked like the others).

``BaseDiffusionLM`` runs all three for both the local model and the swarm client, and the HTTP API runs
them before a request waits for the model, so an oversized request is refused with a ``ValueError`` (400)
before it allocates anything.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from swarm.diffusion.remasking import STRATEGIES
from swarm.utils.settings import (  # noqa: F401 (the settings mechanism, re-exported where it was first defined)
    Setting,
    SettingError,
    SettingField,
    is_integer,
    is_number,
    need,
    need_float,
    need_int,
    setting,
    settings_of,
    shown,
)

CACHE_MODES = ("none", "prefix", "dual")
HEAD_ROWS = ("active", "all")  # what a backend's head scores: the rows readers may read, or every row
STALE_CHECKS = ("token", "exact", "none")
MAX_STALENESS = 8  # 5 hid the most of 50 ms per crossing within half a point (docs/ARCHITECTURE.md)

# Bounds of single settings. A Picard window beyond a few states only adds compute (docs/ARCHITECTURE.md);
# beyond these values the other settings change nothing useful and only risk overflow or waste.
MAX_PARALLEL_WINDOW = 32
MAX_DRAFT_STEPS = MAX_PARALLEL_WINDOW - 1  # a verification call evaluates draft_steps + 1 states
MAX_TEMPERATURE = 10.0  # the Gumbel noise already swamps any logit gap
MAX_CFG_SCALE = 10.0  # LLaDA uses 0..3; (cfg + 1) * (cond - uncond) must stay far from overflow
MAX_SEED = 2**63 - 1
MAX_EXPERTS = 8
MAX_EXPERT_NAME = 1024  # an embedded name, a checkpoint path or a DHT domain
MAX_EXPERT_WEIGHT = 10.0
MAX_EXPERT_TAU = 1000.0  # log-probability gaps never come near this: 1000 is "no clipping"
MAX_CORRECTOR_STEPS = 8  # each one is one more denoiser call per step
DEFAULT_TAU = 10.0  # the experts' clipping bound by default (swarm.diffusion.mixture), in nats
# Tokens per position an expert answers (swarm.diffusion.sparse); 0 asks for the whole vocabulary. The default
# keeps an answer for a 32-position block of LLaDA-8B at 32 x 64 x 8 bytes = 16 KiB instead of 16 MB.
DEFAULT_EXPERT_TOP_K = 64
MAX_EXPERT_TOP_K = 4096  # beyond, ask for the whole vocabulary (0)
MEMORY_FRACTION = 0.25  # of this machine's memory, for one request's denoiser calls (the default budget)
FALLBACK_MEMORY_BYTES = 4 << 30  # when the machine's memory cannot be read


@dataclass(frozen=True)
class GenerationConfig:
    """LLaDA-style semi-autoregressive masked diffusion.

    ``gen_length`` masked positions follow the prompt, split into blocks of ``block_length`` filled left
    to right; ``steps`` are spread evenly over the blocks. With ``threshold`` set, a step unmasks every
    position whose confidence reaches it (at least one), so a block may finish in fewer steps.

    Latency hiding (approximate unless at its default): ``cache`` reuses keys and values of positions
    outside the active block (``prefix``: those before it; ``dual``: before and after), refilled at every
    block and every ``cache_refresh`` steps (0: only at blocks; 1: every step, which is exact), and with
    ``cache_refresh_drift`` whenever a reused pass's predictions moved past that bound from the fill's; ``staleness``
    s lets each step decide on logits s steps old, so s + 1 denoiser calls are in flight at once. Each such
    step is a guess that the logits of its own state, arriving s steps later, confirm or overturn
    (``stale_check``): ``token`` (each token it unmasked is the one its own logits predict there), ``exact``
    (the same step exactly: the tokens equal the exact run's) or ``none`` (never checked). An overturned step
    is redone from its own logits and the guesses after it are dropped.

    Each field is declared once, with its help text and bounds (:func:`setting`): validation, the command
    line, the HTTP API and the documentation test all read the declaration. Lengths must also fit the model
    (:class:`GenerationLimits`).
    """

    gen_length: int = setting(64, "Number of tokens to generate (the prompt plus gen_length must fit the model's "
                                  "context). Hugging Face's max_new_tokens is the same setting.",
                              flags=("--gen-length", "--max-new-tokens"), low=1)
    steps: int = setting(64, "Denoising steps, spread evenly over the blocks.",
                         computed_default="gen_length, one token per step", low=1)
    block_length: int = setting(32, "Semi-autoregressive block size; blocks are filled left to right.",
                                computed_default="32 when it divides gen_length, else gen_length", low=1)
    temperature: float = setting(0.0, "Gumbel noise scale; 0 is greedy.", low=0.0, high=MAX_TEMPERATURE)
    remasking: str = setting("low_confidence", "Which masked positions are unmasked first.", choices=STRATEGIES)
    threshold: Optional[float] = setting(None, "Unmask every position whose confidence reaches this (Fast-dLLM); "
                                               "at least one per step.", low=0.0, high=1.0, low_open=True)
    cfg_scale: float = setting(0.0, "Unsupervised classifier-free guidance scale; 0 disables it.",
                               low=0.0, high=MAX_CFG_SCALE)
    seed: int = setting(0, "Seed of the per-step noise: same seed, same tokens.", low=0, high=MAX_SEED,
                        computed_default="a random seed when temperature > 0 (the result's info['settings'] says "
                                         "which), else 0")
    stop_at_eos: bool = setting(True, "Stop once a finished block contains an end-of-sequence token.")
    parallel_window: int = setting(1, "Picard window: states evaluated per denoiser call (1 is sequential; "
                                      "identical tokens).", low=1, high=MAX_PARALLEL_WINDOW)
    draft_steps: int = setting(0, "Draft-and-verify: steps drafted from the last verified state's own pass and "
                                  "checked in one batched call of draft_steps + 1 states (0 is off; identical "
                                  "tokens).", low=0, high=MAX_DRAFT_STEPS)
    staleness: int = setting(0, "Steps decide on logits this many steps old, keeping that many more calls in "
                                "flight; each is checked when its own logits arrive (0 is exact).",
                             low=0, high=MAX_STALENESS)
    stale_check: str = setting("token", "How a step decided on stale logits is checked against its own: token "
                                        "(each token it unmasked is predicted there), exact (same tokens as the "
                                        "exact run) or none; a failed check redoes the step.", choices=STALE_CHECKS)
    cache: str = setting("none", "Reuse keys/values outside the active block: prefix (before it) or dual (before "
                                 "and after); none is exact.", choices=CACHE_MODES)
    cache_refresh: int = setting(0, "Refill the cache every N steps (0: only at each new block; 1: every step, "
                                    "which is exact).", low=0, high="steps")
    cache_refresh_drift: Optional[float] = setting(
        None, "Adaptive cache refresh: refill as soon as a reused pass's top-two margin at a masked position of the "
              "active block moved more than this from the last fill's (with cache_refresh: whichever comes first).",
        low=0.0, high=1.0)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    @property
    def states_per_call(self) -> int:
        """States one denoiser call evaluates: a Picard window, or a draft-and-verify call's verified states."""
        return max(self.parallel_window, self.draft_steps + 1)

    @property
    def rows_per_state(self) -> int:
        """Sequences per evaluated state: two with classifier-free guidance (conditional and unconditional)."""
        return 2 if self.cfg_scale > 0 else 1

    def validate(self) -> None:
        fields = settings_of(type(self))  # a subclass's added settings are checked too
        for field in fields:  # integers first: the lengths are compared with each other next
            value = getattr(self, field.name)
            need(field.kind is not int or is_integer(value), f"{field.name} must be an integer, got {shown(value)}",
                 field.name)
        self._validate_lengths()
        for field in fields:  # then each setting against its declaration
            field.check(getattr(self, field.name), self)
        need(self.parallel_window == 1 or (self.staleness == 0 and self.cache == "none"),
             "parallel_window > 1 is exact only over a stateless denoiser: use it with staleness=0 and cache='none'")
        need(self.draft_steps == 0 or (self.staleness == 0 and self.cache == "none"),
             "draft_steps > 0 is exact only over a stateless denoiser: use it with staleness=0 and cache='none'",
             "draft_steps")
        need(self.draft_steps == 0 or self.parallel_window == 1,
             "draft_steps and parallel_window both choose the states of a batched call: set one of them",
             "draft_steps")

    def _validate_lengths(self) -> None:
        need(self.gen_length > 0, f"gen_length must be positive, got {self.gen_length}", "gen_length")
        need(self.block_length > 0, f"block_length must be positive, got {self.block_length}", "block_length")
        need(self.gen_length % self.block_length == 0,
             f"gen_length ({self.gen_length}) must be divisible by block_length ({self.block_length})", "block_length")
        need(self.steps >= self.num_blocks,
             f"steps ({self.steps}) must be at least the number of blocks ({self.num_blocks} = "
             f"gen_length {self.gen_length} / block_length {self.block_length})", "steps")
        need(self.steps % self.num_blocks == 0,
             f"steps ({self.steps}) must be divisible by the number of blocks ({self.num_blocks})", "steps")
        need(self.steps_per_block <= self.block_length,
             f"steps per block ({self.steps_per_block}) exceeds block_length ({self.block_length}): "
             "some steps would unmask nothing; lower steps or raise block_length", "steps")

    def replace(self, **changes: Any) -> "GenerationConfig":
        return dataclasses.replace(self, **changes)


def machine_memory_bytes() -> int:
    """This machine's physical memory (a fallback when the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return FALLBACK_MEMORY_BYTES


@dataclass(frozen=True)
class GenerationLimits:
    """Bounds that follow from the model and the machine, checked before any compute.

    ``bytes_per_token`` estimates what one sequence position costs during one denoiser call: float32
    logits and one temporary copy (2 x vocab), the residual stream, q/k/v and attention output (12 x
    hidden) and the MLP (4 x intermediate), 4 bytes each. Measured on the default model (vocab 260, hidden
    128, 1024 positions; ``peak RSS growth / tokens`` of one forward): 9.4-13.6 KB per token, estimate 13.9 KB.
    The budget is never below one sequence at full context, so every request the model can take at all, with
    one state and no guidance, is allowed.
    """

    max_positions: int
    bytes_per_token: int
    memory_budget: int  # bytes that one request's denoiser calls may hold at once

    @classmethod
    def for_model(cls, config: Any, memory_budget: Optional[int] = None) -> "GenerationLimits":
        """Limits for a :class:`~swarm.models.config.ModelConfig`; the budget defaults to 1/4 of this machine."""
        per_token = 4 * (2 * config.vocab_size + 12 * config.hidden_size + 4 * config.intermediate_size)
        budget = int(machine_memory_bytes() * MEMORY_FRACTION) if memory_budget is None else int(memory_budget)
        return cls(int(config.max_position_embeddings), per_token, budget)

    @property
    def max_resident_tokens(self) -> int:
        """Sequence positions one request may hold in denoiser calls at once."""
        return max(self.max_positions, self.memory_budget // self.bytes_per_token)

    @staticmethod
    def resident_tokens(generation: GenerationConfig, prompt_length: int, experts: int = 0, window: int = 0) -> int:
        """Positions held at once: rows per call x calls in flight x models (backbone and experts) x sequence."""
        rows = (window or generation.states_per_call) * generation.rows_per_state
        return rows * (generation.staleness + 1) * (1 + experts) * (prompt_length + generation.gen_length)

    def window_room(self, generation: GenerationConfig, prompt_length: int, experts: int = 0) -> int:
        """The most states per call (a Picard window, draft_steps + 1) this request fits in memory (at least 1)."""
        one_state = self.resident_tokens(generation, prompt_length, experts, window=1)
        return max(1, min(MAX_PARALLEL_WINDOW, self.max_resident_tokens // one_state))

    def check(self, generation: GenerationConfig, prompt_length: Optional[int] = None, experts: int = 0) -> None:
        """Refuse a request that does not fit the model's positions or the memory budget.

        ``prompt_length`` is None before the prompt is tokenised (the early check of the HTTP API): it then
        counts as one token. ``experts`` counts the experts that compute alongside the backbone.
        """
        if prompt_length is None:
            need(generation.gen_length < self.max_positions,
                 f"gen_length ({generation.gen_length}) + a prompt exceeds the model's context of "
                 f"{self.max_positions} positions", "gen_length")
            prompt_length = 1
        need(generation.gen_length <= self.max_positions - prompt_length,
             f"prompt ({prompt_length} tokens) + gen_length ({generation.gen_length}) exceeds the model's "
             f"context of {self.max_positions} positions", "gen_length")
        held = self.resident_tokens(generation, prompt_length, experts)
        room = self.max_resident_tokens
        need(held <= room,
             f"this request would hold {held} sequence positions in memory at once ({generation.states_per_call} "
             f"states per call (parallel_window, draft_steps + 1) x {generation.rows_per_state} for cfg_scale x "
             f"{generation.staleness + 1} calls in flight x {1 + experts} models x ({prompt_length} prompt + "
             f"{generation.gen_length} generated) positions); the limit here is {room} "
             f"({self.memory_budget >> 20} MiB at {self.bytes_per_token} bytes per position): "
             "lower parallel_window, draft_steps, staleness, cfg_scale, experts or gen_length",
             "draft_steps" if generation.draft_steps else "parallel_window")


def check_experts(experts: Any) -> int:
    """Check ``experts`` (None, ``"auto"`` or ``{name: weight}``).

    Returns how many given experts have a weight above 0 (they compute alongside the backbone).
    """
    if experts is None or experts == "auto":
        return 0  # "auto" picks from a fixed table of experts and weights
    need(isinstance(experts, Mapping), f"experts must be 'auto' or a mapping of name to weight, got {shown(experts)}",
         "experts")
    need(len(experts) <= MAX_EXPERTS, f"at most {MAX_EXPERTS} experts per request, got {len(experts)}", "experts")
    for name, weight in experts.items():
        need(isinstance(name, str) and 0 < len(name) <= MAX_EXPERT_NAME,
             f"expert names must be strings of 1..{MAX_EXPERT_NAME} characters, got {shown(name)}", "experts")
        need_float(f"the weight of expert {shown(name)}", weight, 0.0, MAX_EXPERT_WEIGHT, param="experts")
    return sum(1 for weight in experts.values() if weight > 0)
