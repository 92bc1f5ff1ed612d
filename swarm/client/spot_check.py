"""Spot checks: re-execute some span computations on an independent server and compare.

A server whose output disagrees with the majority (the checker plus a third server as tie-breaker) is
distrusted for the rest of the session, reported in the result and the log, and never used again by
this client. The majority's output is what the generation continues with.

A check that finds no majority (two servers disagree and no third holds the blocks) is *unresolved*: it
is reported in the result, the checked server is avoided from then on (the generation continues with the
checker's answer and route), and under a policy that requires verified tokens (the ``restricted`` tier)
the generation stops with :class:`UnverifiedResultError` instead of returning unverified tokens.

Reuse passes of the activation cache are checked too: the checker first receives the same fill the
checked server reused (the client keeps each hop's fill input while checks are on), then the reuse.
"""
from __future__ import annotations

import logging
import random
import threading
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from swarm.client.config import ClientConfig
from swarm.client.failover import SwarmError
from swarm.client.peers import PeerHealth
from swarm.protocol import ForwardRequest, RemoteError
from swarm.remote import RemoteCaller
from swarm.utils.event_loop import BackgroundLoop

logger = logging.getLogger(__name__)

UNRESOLVED = "unresolved"
NO_CHECKER = "no_checker"


class UnverifiedResultError(SwarmError):
    """A spot check found no majority under a policy that accepts only verified results."""


@dataclass
class SpotCheckOutcome:
    step: int
    blocks: tuple[int, int]
    primary: str
    checkers: list[str]
    verdict: str  # "agreed", "primary_faulty", "checker_faulty", "unresolved", "no_checker"
    reuse: bool = False  # the checked call reused the activation cache

    def to_dict(self) -> dict:
        return {"step": self.step, "blocks": list(self.blocks), "primary": self.primary,
                "checkers": self.checkers, "verdict": self.verdict, "reuse": self.reuse}


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / (b.float().norm() + 1e-12))


def answers_agree(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    """Two servers' answers to one request agree: hidden states within ``rtol``; a head server's predictions
    (float64 rows of token, probability, margin, negative entropy) with the same tokens and confidences within
    ``rtol`` (a relative norm would hide one wrong token among large ids)."""
    if a.shape != b.shape:
        return False
    if a.dtype != torch.float64:
        return relative_difference(a, b) <= rtol
    return torch.equal(a[..., 0], b[..., 0]) and relative_difference(a[..., 1:], b[..., 1:]) <= rtol


class FillInputs:
    """The hidden states each hop's cache fills were computed from, so a checker can rebuild the same cache.

    Keyed by (session, start, end, version); versions older than a fill's ``keep_from`` are dropped with it,
    exactly as servers drop them.
    """

    def __init__(self) -> None:
        self._inputs: dict[tuple[str, int, int, int], torch.Tensor] = {}
        self._lock = threading.Lock()  # calls in flight (stale pipelining) remember fills concurrently

    def remember(self, request: ForwardRequest) -> None:
        directive = request.extra["cache"]
        keep_from = directive.get("keep_from", 0)
        with self._lock:
            for key in [k for k in self._inputs if k[0] == request.session_id and k[3] < keep_from]:
                del self._inputs[key]
            self._inputs[(request.session_id, request.start, request.end, directive["version"])] = request.hidden

    def lookup(self, request: ForwardRequest) -> Optional[torch.Tensor]:
        version = request.extra["cache"]["version"]
        with self._lock:
            return self._inputs.get((request.session_id, request.start, request.end, version))

    def clear(self) -> None:
        with self._lock:
            self._inputs.clear()


class SpotChecker:
    """Draws which hops to check (from a seed: reproducible) and follows the majority of the answers."""

    def __init__(self, health: PeerHealth, caller: RemoteCaller, loop: BackgroundLoop, config: ClientConfig,
                 holders: Callable[[int, int, frozenset[str], bool, Optional[str]], list[str]]):
        self.health, self.caller, self.loop, self.config = health, caller, loop, config
        self.holders = holders
        self.rtol = config.spot_check_rtol
        self.fraction = config.spot_check_fraction
        self.require_verified = False  # set by the request's policy: stop instead of returning unverified tokens
        self.rng = random.Random(config.spot_check_seed)
        self.outcomes: list[SpotCheckOutcome] = []
        self.fills = FillInputs()

    def maybe_check(self, request: ForwardRequest, primary: str, output: torch.Tensor) -> torch.Tensor:
        if self.fraction <= 0:
            return output
        cache = request.extra.get("cache")
        if cache is not None and cache["rows"] is None:
            self.fills.remember(request)
        if self.rng.random() >= self.fraction:
            return output
        return self.check(request, primary, output)

    def check(self, request: ForwardRequest, primary: str, output: torch.Tensor) -> torch.Tensor:
        """Compare with a second server; on disagreement ask a third and follow the majority."""
        asked: list[str] = []
        answers: dict[str, torch.Tensor] = {primary: output}
        kind = request.prompt_kind if request.prompts is not None else None
        for peer in self.holders(request.start, request.end, frozenset({primary}), "head" in request.extra, kind):
            result = self._call(peer, request)
            if result is None:
                continue
            asked.append(peer)
            answers[peer] = result
            verdict = self._verdict(answers, primary)
            if verdict is not None:
                return self._conclude(request, primary, asked, answers, verdict)
        verdict = NO_CHECKER if not asked else UNRESOLVED
        self._record(request, primary, asked, verdict)
        if verdict == UNRESOLVED:
            return self._unresolved(request, primary, asked, answers)
        if self.require_verified:  # nothing to compare with: unverified, which this request does not accept
            raise UnverifiedResultError(
                f"no other usable server holds blocks {request.start}:{request.end} to check {primary[-8:]} at step "
                f"{request.step}; this request accepts only verified results, so every span needs two holders it "
                "may use (for a restricted request: two trusted peers)")
        return output

    def _unresolved(self, request: ForwardRequest, primary: str, asked: list[str],
                    answers: dict[str, torch.Tensor]) -> torch.Tensor:
        what = (f"spot check of {primary[-8:]} on blocks {request.start}:{request.end} at step {request.step} "
                f"unresolved: {', '.join(p[-8:] for p in asked)} disagreed and no third server holds these blocks")
        if self.require_verified:
            raise UnverifiedResultError(f"{what}; this request accepts only verified results")
        self.health.dispute(primary, what)
        return answers[asked[0]]

    def _call(self, peer: str, request: ForwardRequest) -> Optional[torch.Tensor]:
        """The checker's answer to ``request``; for a reuse pass, after the same fill. None if it failed."""
        try:
            cache = request.extra.get("cache")
            if cache is None or cache["rows"] is None:
                return self._forward(peer, request)
            return self._forward_reuse(peer, request)
        except RemoteError as error:
            self.health.record_failure(peer, f"failed a spot check call: {error}")
            return None

    def _forward(self, peer: str, request: ForwardRequest) -> torch.Tensor:
        return self.loop.run(self.caller.forward(peer, request, self.config.request_timeout))

    def _forward_reuse(self, peer: str, request: ForwardRequest) -> Optional[torch.Tensor]:
        """Rebuild the reused cache on ``peer`` in a session of the check's own, then run the reuse there."""
        fill_input = self.fills.lookup(request)
        if fill_input is None:
            logger.info("cannot check a reuse of blocks %d:%d: its fill went through another route",
                        request.start, request.end)
            return None
        directive = request.extra["cache"]
        version = directive["version"]
        session = f"check-{uuid.uuid4().hex}"
        fill = ForwardRequest(request.start, request.end, fill_input, session, request.step,
                              {"cache": {"rows": None, "version": version, "keep_from": version}}, request.prompts,
                              request.prompt_kind)
        self._forward(peer, fill)
        reuse = ForwardRequest(request.start, request.end, request.hidden, session, request.step,
                               {"cache": dict(directive, keep_from=version)}, request.prompts, request.prompt_kind)
        return self._forward(peer, reuse)

    def _verdict(self, answers: dict[str, torch.Tensor], primary: str) -> Optional[str]:
        peers = list(answers)
        if len(peers) == 2:
            agree = answers_agree(answers[peers[1]], answers[primary], self.rtol)
            return "agreed" if agree else None
        # Three answers: the odd one out is faulty.
        a, b, c = peers[0], peers[1], peers[2]
        ab = answers_agree(answers[a], answers[b], self.rtol)
        ac = answers_agree(answers[a], answers[c], self.rtol)
        bc = answers_agree(answers[b], answers[c], self.rtol)
        if bc and not ab and not ac:
            return "primary_faulty"
        if ac and not ab:
            return "checker_faulty"
        return None

    def _conclude(self, request, primary, asked, answers, verdict: str) -> torch.Tensor:
        self._record(request, primary, asked, verdict)
        if verdict == "agreed":
            return answers[primary]
        liar = primary if verdict == "primary_faulty" else asked[0]
        self.health.distrust(liar, f"spot check: returned wrong results for blocks {request.start}:{request.end}")
        honest = asked[-1] if verdict == "primary_faulty" else primary
        return answers[honest]

    def _record(self, request: ForwardRequest, primary: str, asked: list[str], verdict: str) -> None:
        reuse = request.extra.get("cache", {}).get("rows") is not None
        self.outcomes.append(SpotCheckOutcome(request.step, (request.start, request.end), primary, asked, verdict,
                                              reuse))
