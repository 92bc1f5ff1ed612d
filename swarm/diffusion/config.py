"""Settings of one generation, checked once, before any compute."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from swarm.diffusion.remasking import STRATEGIES

CACHE_MODES = ("none", "prefix", "dual")
STALE_CHECKS = ("token", "exact", "none")
MAX_STALENESS = 3


@dataclass(frozen=True)
class GenerationConfig:
    """LLaDA-style semi-autoregressive masked diffusion.

    ``gen_length`` masked positions follow the prompt, split into blocks of ``block_length`` filled left
    to right; ``steps`` are spread evenly over the blocks. With ``threshold`` set, a step unmasks every
    position whose confidence reaches it (at least one), so a block may finish in fewer steps.

    Latency hiding (approximate unless at its default): ``cache`` reuses keys and values of positions
    outside the active block (``prefix``: those before it; ``dual``: before and after), refilled at every
    block and every ``cache_refresh`` steps (0: only at blocks; 1: every step, which is exact); ``staleness``
    s lets each step decide on logits s steps old, so s + 1 denoiser calls are in flight at once. Each such
    step is a guess that the logits of its own state, arriving s steps later, confirm or overturn
    (``stale_check``): ``token`` (each token it unmasked is the one its own logits predict there), ``exact``
    (the same step exactly: the tokens equal the exact run's) or ``none`` (never checked). An overturned step
    is redone from its own logits and the guesses after it are dropped.
    """

    gen_length: int = 64
    steps: int = 64
    block_length: int = 32
    temperature: float = 0.0
    remasking: str = "low_confidence"
    threshold: Optional[float] = None
    cfg_scale: float = 0.0
    seed: int = 0
    stop_at_eos: bool = True
    parallel_window: int = 1
    staleness: int = 0
    stale_check: str = "token"
    cache: str = "none"
    cache_refresh: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    def validate(self) -> None:
        def need(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(message)

        for name in ("gen_length", "steps", "block_length", "seed", "parallel_window", "staleness", "cache_refresh"):
            need(isinstance(getattr(self, name), int), f"{name} must be an integer, got {getattr(self, name)!r}")
        need(self.gen_length > 0, f"gen_length must be positive, got {self.gen_length}")
        need(self.block_length > 0, f"block_length must be positive, got {self.block_length}")
        need(self.gen_length % self.block_length == 0,
             f"gen_length ({self.gen_length}) must be divisible by block_length ({self.block_length})")
        need(self.steps >= self.num_blocks,
             f"steps ({self.steps}) must be at least the number of blocks ({self.num_blocks} = "
             f"gen_length {self.gen_length} / block_length {self.block_length})")
        need(self.steps % self.num_blocks == 0,
             f"steps ({self.steps}) must be divisible by the number of blocks ({self.num_blocks})")
        need(self.steps_per_block <= self.block_length,
             f"steps per block ({self.steps_per_block}) exceeds block_length ({self.block_length}): "
             "some steps would unmask nothing; lower steps or raise block_length")
        need(self.remasking in STRATEGIES,
             f"unknown remasking {self.remasking!r}; choose one of {', '.join(STRATEGIES)}")
        need(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        need(self.cfg_scale >= 0, f"cfg_scale must be >= 0, got {self.cfg_scale}")
        need(self.threshold is None or 0.0 < self.threshold <= 1.0,
             f"threshold must be in (0, 1], got {self.threshold}")
        need(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        need(self.parallel_window >= 1, f"parallel_window must be >= 1, got {self.parallel_window}")
        need(0 <= self.staleness <= MAX_STALENESS, f"staleness must be 0..{MAX_STALENESS}, got {self.staleness}")
        need(self.stale_check in STALE_CHECKS,
             f"unknown stale_check {self.stale_check!r}; choose one of {', '.join(STALE_CHECKS)}")
        need(self.cache in CACHE_MODES, f"unknown cache {self.cache!r}; choose one of {', '.join(CACHE_MODES)}")
        need(self.cache_refresh >= 0, f"cache_refresh must be >= 0 steps, got {self.cache_refresh}")
        need(self.parallel_window == 1 or (self.staleness == 0 and self.cache == "none"),
             "parallel_window > 1 is exact only over a stateless denoiser: use it with staleness=0 and cache='none'")

    def replace(self, **changes: Any) -> "GenerationConfig":
        return dataclasses.replace(self, **changes)
