"""Scale by need: how much of the swarm one request uses (``generate(..., scale=...)``).

* ``local``: run on the caller's machine alone; needs every block's weights in the local checkpoint.
* ``auto`` (default): size what is used to the request. Picard windows of 4 when the remasking order is
  ``random`` (measured: 3.2x fewer round trips, identical tokens); for the confidence orders, whose Picard
  windows accept too few states to pay for the extra rows, draft-and-verify with 3 drafted steps (measured:
  1.6x fewer round trips on prose, 2.4x on the addition expert, identical tokens). Spot checks follow the
  safety tier.
* ``max``: use every suitable server: spot-check every hop on a replica when one exists, Picard windows of 8
  for ``random`` remasking and 7 drafted steps for the others, and experts picked from the prompt when none
  were asked for (experts change the tokens; windows, drafts and spot checks never do).

Explicit arguments always win: a request that sets ``parallel_window``, ``draft_steps`` or ``experts`` keeps
them, and one that asks for ``staleness`` or a ``cache`` gets neither windows nor drafts (both need the exact,
stateless denoiser). Windows and drafts the scale chose shrink to what the request's memory bound allows
(``GenerationLimits.window_room``); those the caller chose are refused when they do not fit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

if TYPE_CHECKING:  # the answer's type only: command lines plan before torch is imported
    from swarm.models.invariance import DeviceInvariance

SCALES = ("local", "auto", "max")


@dataclass(frozen=True)
class ScalePlan:
    scale: str
    spot_check_fraction: float  # a floor; tiers and client settings may ask for more
    settings: Mapping[str, Any] = field(default_factory=dict)  # generation settings the scale chose
    experts: Any = None  # experts the scale chose ("auto"), when the caller asked for none
    # Whether the passes that would compute batched states are batch-invariant, when the scale asked (it batches
    # states only where they are: elsewhere a batched row could change a token at a near-tie)
    invariance: Optional["DeviceInvariance"] = None

    @property
    def filled(self) -> tuple[str, ...]:
        """What the scale chose (not the caller): it may be fitted to the limits."""
        return tuple(self.settings) + (("experts",) if self.experts is not None else ())

    def info(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def batching_info(self, states_per_call: int) -> dict[str, Any]:
        """What ``info["settings"]["batching"]`` says: the states per call, who chose them, and whether (and why)
        batched states give the sequential run's tokens here."""
        chosen_by = "scale" if {"parallel_window", "draft_steps"} & set(self.settings) else (
            "caller" if states_per_call > 1 else "none")
        info: dict[str, Any] = {"states_per_call": states_per_call, "chosen_by": chosen_by}
        if self.invariance is not None:
            info.update(self.invariance.to_json())
            if not self.invariance.exact and chosen_by != "caller":
                info["why"] = f"scale={self.scale} batches no states here: {self.invariance.why}"
        return info


BATCHED_STATES = {"auto": 4, "max": 8}  # states per call the scale asks for (the memory bound may shrink them)


def batching(remasking: Any, scale: str) -> dict[str, int]:
    """How the scale batches states into one call: Picard windows for ``random`` remasking (its positions are
    fixed by the seed, so guessed states hold), draft-and-verify for the confidence orders (and the model's own
    default order, ``remasking`` None: drafts save round trips for every order, windows only for ``random``)."""
    states = BATCHED_STATES[scale]
    return {"parallel_window": states} if remasking == "random" else {"draft_steps": states - 1}


def check_scale(scale: str) -> str:
    if not isinstance(scale, str) or scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    return scale


def plan_scale(scale: str, settings: Mapping[str, Any], remote: bool, experts: Any = None,
               correctors: int = 0, invariance: Optional[Callable[[], "DeviceInvariance"]] = None) -> ScalePlan:
    """The plan for one request: the generation settings and experts the scale chooses, and its spot checks.

    ``settings`` (the caller's generation settings) and ``experts`` (the caller's) are read, never changed;
    the plan holds what the scale fills in. Picard windows only pay off when each denoiser call is a network
    round trip (``remote``); ``correctors`` (the request's ``corrector_steps``) make calls of their own in every
    step, so the scale batches no states for them. ``invariance`` says whether the passes are batch-invariant (asked
    only when the scale would batch states, or the caller did): where they are not, the scale batches none.
    """
    check_scale(scale)
    if scale == "local":
        return ScalePlan(scale, 0.0)
    chosen: dict[str, Any] = {}
    exact = settings.get("staleness", 0) == 0 and settings.get("cache", "none") == "none"  # windows need exactness
    batched = "parallel_window" in settings or "draft_steps" in settings  # the caller chose how calls batch
    found = None
    if invariance is not None and (batched or (remote and exact and not correctors)):
        found = invariance()
    if remote and exact and not batched and not correctors and (found is None or found.exact):
        chosen.update(batching(settings.get("remasking"), scale))
    auto_experts = "auto" if scale == "max" and experts is None else None
    return ScalePlan(scale, 1.0 if scale == "max" else 0.0, chosen, auto_experts, found)
