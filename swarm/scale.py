"""Scale by need: how much of the swarm one request uses (``generate(..., scale=...)``).

* ``local``: run on the caller's machine alone; needs every block's weights in the local checkpoint.
* ``auto`` (default): size what is used to the request. Picard windows of 4 when the remasking order is
  ``random`` (measured: 3.2x fewer round trips, identical tokens); confidence orders accept too few states
  per window to pay for the extra rows, so they stay sequential. Spot checks follow the safety tier.
* ``max``: use every suitable server: spot-check every hop on a replica when one exists, Picard windows of 8
  for ``random`` remasking, and experts picked from the prompt when none were asked for (experts change the
  tokens; windows and spot checks never do).

Explicit arguments always win: a request that sets ``parallel_window`` or ``experts`` keeps them, and one
that asks for ``staleness`` or a ``cache`` gets no window (windows need the exact, stateless denoiser). A
window the scale chose shrinks to what the request's memory bound allows (``GenerationLimits.window_room``);
one the caller chose is refused when it does not fit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

SCALES = ("local", "auto", "max")


@dataclass(frozen=True)
class ScalePlan:
    scale: str
    spot_check_fraction: float  # a floor; tiers and client settings may ask for more
    settings: Mapping[str, Any] = field(default_factory=dict)  # generation settings the scale chose
    experts: Any = None  # experts the scale chose ("auto"), when the caller asked for none

    @property
    def filled(self) -> tuple[str, ...]:
        """What the scale chose (not the caller): it may be fitted to the limits."""
        return tuple(self.settings) + (("experts",) if self.experts is not None else ())

    def info(self) -> dict[str, Any]:
        return {"scale": self.scale}


def check_scale(scale: str) -> str:
    if not isinstance(scale, str) or scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    return scale


def plan_scale(scale: str, settings: Mapping[str, Any], remote: bool, experts: Any = None) -> ScalePlan:
    """The plan for one request: the generation settings and experts the scale chooses, and its spot checks.

    ``settings`` (the caller's generation settings) and ``experts`` (the caller's) are read, never changed;
    the plan holds what the scale fills in. Picard windows only pay off when each denoiser call is a network
    round trip (``remote``).
    """
    check_scale(scale)
    if scale == "local":
        return ScalePlan(scale, 0.0)
    chosen: dict[str, Any] = {}
    exact = settings.get("staleness", 0) == 0 and settings.get("cache", "none") == "none"  # windows need exactness
    if remote and exact and settings.get("remasking") == "random" and "parallel_window" not in settings:
        chosen["parallel_window"] = 8 if scale == "max" else 4
    auto_experts = "auto" if scale == "max" and experts is None else None
    return ScalePlan(scale, 1.0 if scale == "max" else 0.0, chosen, auto_experts)
