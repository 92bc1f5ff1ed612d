"""What a fine-tuning run is asked to do (:class:`FinetuneConfig`, :class:`CollaborationConfig`) and the pure rules
on it (kind defaults, the learning-rate schedule, which settings define a run): plain data importing neither torch nor
hivemind, so that ``python -m swarm.finetune --help`` declares its options' defaults at once.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from swarm.adapters.kinds import LORA, SOFT_PROMPT, size_setting

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # hivemind refuses '.' in its averaging group names


@dataclass
class CollaborationConfig:
    """How a peer joins a collaboration (swarm/finetune/together.py); times in seconds."""

    run_id: str
    target_batch_size: int  # samples of all peers together per optimizer step
    matchmaking_time: float = 2.0  # how long an averaging round waits for peers to join it
    averaging_timeout: float = 15.0  # an all-reduce that takes longer fails; the peer then steps on its own
    load_state_timeout: float = 60.0  # a joining peer waits this long for the others' state
    progress_expiration: float = 15.0  # a peer silent this long no longer counts towards the global batch
    min_peers: int = 1  # after its first batch, a peer waits until this many peers (itself included) report
    peer_wait: float = 120.0  # ... for at most this long (then TooFewPeers: exit 3)

    def validate(self, batch_size: int) -> None:
        if not RUN_ID.fullmatch(self.run_id):
            raise ValueError(f"--run-id {self.run_id!r}: use 1-64 letters, digits, '_' or '-', starting with a "
                             "letter or digit")
        if self.target_batch_size < batch_size:
            raise ValueError(f"--target-batch-size {self.target_batch_size} is below --batch-size {batch_size}: "
                             "each optimizer step needs at least one peer's batch")
        if self.min_peers < 1:
            raise ValueError(f"--min-peers must be at least 1, got {self.min_peers}")
        for name in ("matchmaking_time", "averaging_timeout", "load_state_timeout", "progress_expiration",
                     "peer_wait"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CollaborationConfig.{name} must be positive, got {getattr(self, name)!r}")


# Settings that change what a resumed run computes: a mismatch is refused, not silently mixed.
RUN_DEFINING = ("batch_size", "prompt_length", "seed", "data_sha256", "adapter_kind", "pad_response", "rank",
                "head_rank", "down_scale", "max_grad_norm")
# Settings whose default depends on the adapter's kind: a LoRA learns only with its up projections faster than its
# down ones and with its rare huge gradients clipped (docs/TRAINING.md, finding 4); other kinds train as they did.
KIND_DEFAULTED = ("down_scale", "max_grad_norm")
KIND_DEFAULTS = {LORA: {"down_scale": 4.0, "max_grad_norm": 1.0}}
PLAIN_DEFAULTS = {"down_scale": 1.0, "max_grad_norm": 0.0}  # also what runs saved before these settings used


def kind_defaults(kind: str) -> dict[str, float]:
    """The defaults of :data:`KIND_DEFAULTED` for a new run of adapter ``kind``."""
    return KIND_DEFAULTS.get(kind, PLAIN_DEFAULTS)


@dataclass
class FinetuneConfig:
    data: str
    output: str
    steps: int = 100
    lr: float = 1e-2
    # (step, lr) pairs: from that optimizer step on, the learning rate is lr (a step schedule; --lr before the first)
    lr_from: tuple[tuple[int, float], ...] = ()
    batch_size: int = 8
    prompt_length: int = 16
    adapter_kind: str = SOFT_PROMPT  # soft_prompt (vectors before the first block), deep_prompt, bottleneck or lora
    rank: int = 16  # a bottleneck's or LoRA's rank (per block: 2 x rank x hidden weights; rank x every projection's)
    head_rank: int = 0  # the rank of a correction of the client's output head (0: none)
    # None: the kind's default (KIND_DEFAULTS; a resumed run keeps what it was started with)
    down_scale: Optional[float] = None  # a new adapter's down projections start this many times unit scale (LoRA+)
    max_grad_norm: Optional[float] = None  # clip each batch's gradient to this norm before the step (0: never)
    pad_response: int = 0  # EOS-pad every response to at least this many tokens (generation's gen_length)
    seed: int = 0
    save_every: int = 10
    data_sha256: str = ""  # filled from the data file
    # The data may grow between resumptions (python -m swarm.improve): a resumed run may then see other data
    growing_data: bool = False
    # Set to train together with every process of the same run id (hivemind.Optimizer over the DHT)
    collaboration: Optional[CollaborationConfig] = None

    def __post_init__(self) -> None:
        """The new-adapter and optimiser settings any caller (command, benchmark, library) may get wrong."""
        if self.down_scale is not None and not (math.isfinite(self.down_scale) and self.down_scale > 0):
            raise ValueError(f"down_scale must be a positive number, got {self.down_scale!r}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0):
            raise ValueError(f"max_grad_norm must be a number >= 0 (0: no clipping), got {self.max_grad_norm!r}")

    def fill_defaults(self, saved: Optional[dict[str, Any]] = None) -> None:
        """Settings left at None take the ``saved`` run's values when resuming one (runs saved before a setting
        existed ran with its old default), else the kind's default."""
        before = saved_settings(saved) if saved is not None else kind_defaults(self.adapter_kind)
        for name in KIND_DEFAULTED:
            if getattr(self, name) is None:
                setattr(self, name, before[name])

    def lr_at(self, epoch: int) -> float:
        """The learning rate of optimizer step ``epoch`` (counted from 0)."""
        return lr_at(self.lr, self.lr_from, epoch)

    def run_defining(self) -> dict[str, Any]:
        """The settings a resumed run must keep (the collaboration's run id and global batch included)."""
        collaboration = self.collaboration
        target = collaboration.target_batch_size if collaboration else self.batch_size
        defining = [key for key in RUN_DEFINING if not (self.growing_data and key == "data_sha256")]
        return only_relevant({**{key: getattr(self, key) for key in defining},
                              "run_id": collaboration.run_id if collaboration else "", "target_batch_size": target})


def only_relevant(settings: dict[str, Any]) -> dict[str, Any]:
    """Run-defining settings without the size the kind does not use (a prompt's length for a bottleneck, a
    bottleneck's rank for a prompt): changing an unused flag does not change the run."""
    used = size_setting(settings["adapter_kind"])
    return {key: value for key, value in settings.items() if key not in ("rank", "prompt_length") or key == used}


def lr_at(lr: float, lr_from: Iterable[tuple[int, float]], epoch: int) -> float:
    """The rate of optimizer step ``epoch`` under base rate ``lr`` and the (step, lr) changes ``lr_from`` (as saved:
    lists or tuples)."""
    for step, value in sorted((int(step), float(value)) for step, value in lr_from):
        if epoch >= step:
            lr = value
    return lr


def parse_lr_from(values: Iterable[str]) -> tuple[tuple[int, float], ...]:
    """``("2100:0.001", ...)`` -> ``((2100, 0.001), ...)`` sorted, or a ValueError naming the bad entry."""
    schedule = []
    for value in values:
        step, _, lr = value.partition(":")
        try:
            change = (int(step), float(lr))
        except ValueError:
            raise ValueError(f"{value!r} is not STEP:LR (e.g. 2100:0.001)") from None
        if change[0] < 1 or not math.isfinite(change[1]) or change[1] <= 0:
            raise ValueError(f"{value!r}: STEP must be >= 1 and LR a positive number")
        schedule.append(change)
    if len({step for step, _ in schedule}) != len(schedule):
        raise ValueError("one learning rate per step")
    return tuple(sorted(schedule))


def saved_settings(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved run's config with the defaults of runs saved before a setting existed."""
    return {"adapter_kind": SOFT_PROMPT, "pad_response": 0, "rank": FinetuneConfig.rank, "head_rank": 0,
            **PLAIN_DEFAULTS, **{key: value for key, value in saved.items() if value is not None}}
