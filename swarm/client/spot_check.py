"""Spot checks: re-execute some span computations on an independent server and compare.

A server whose output disagrees with the majority (the checker plus a third server as tie-breaker) is
distrusted for the rest of the session, reported in the result and the log, and never used again by
this client. The majority's output is what the generation continues with.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from swarm.dht.schema import ServerState
from swarm.protocol import ForwardRequest, RemoteError

if TYPE_CHECKING:
    from swarm.client.sequence import RemoteSequence

logger = logging.getLogger(__name__)


@dataclass
class SpotCheckOutcome:
    step: int
    blocks: tuple[int, int]
    primary: str
    checkers: list[str]
    verdict: str  # "agreed", "primary_faulty", "checker_faulty", "unresolved", "no_checker"

    def as_dict(self) -> dict:
        return {"step": self.step, "blocks": list(self.blocks), "primary": self.primary,
                "checkers": self.checkers, "verdict": self.verdict}


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / (b.float().norm() + 1e-12))


class SpotChecker:
    def __init__(self, sequence: "RemoteSequence", rtol: float, seed: int):
        self.sequence = sequence
        self.rtol = rtol
        self.fraction = 0.0
        self.rng = random.Random(seed)
        self.outcomes: list[SpotCheckOutcome] = []

    def candidates(self, request: ForwardRequest, exclude: set[str]) -> list[str]:
        """Usable servers holding the request's blocks, fastest first."""
        seq = self.sequence
        avoid = seq.excluded() | exclude
        found = [peer for peer, record in seq.servers.items()
                 if record.state == ServerState.ONLINE and peer not in avoid
                 and record.start <= request.start and request.end <= record.end]
        return sorted(found, key=lambda peer: (seq.latencies.get(peer, float("inf")), peer))

    def maybe_check(self, request: ForwardRequest, primary: str, output: torch.Tensor) -> torch.Tensor:
        if self.fraction <= 0 or self.rng.random() >= self.fraction:
            return output
        return self.check(request, primary, output)

    def _call(self, peer: str, request: ForwardRequest) -> Optional[torch.Tensor]:
        seq = self.sequence
        try:
            return seq.loop.run(seq.caller.forward(peer, request, seq.config.request_timeout))
        except RemoteError as error:
            seq.ban(peer, f"failed a spot check call: {error}")
            return None

    def check(self, request: ForwardRequest, primary: str, output: torch.Tensor) -> torch.Tensor:
        """Compare with a second server; on disagreement ask a third and follow the majority."""
        asked: list[str] = []
        answers: dict[str, torch.Tensor] = {primary: output}
        for peer in self.candidates(request, {primary}):
            result = self._call(peer, request)
            if result is None:
                continue
            asked.append(peer)
            answers[peer] = result
            verdict = self._verdict(answers, primary)
            if verdict is not None:
                return self._conclude(request, primary, asked, answers, verdict)
        verdict = "no_checker" if not asked else "unresolved"
        self._record(request, primary, asked, verdict)
        if verdict == "unresolved":
            logger.warning("spot check of %s on blocks %d:%d unresolved: no majority", primary[-8:], request.start, request.end)
        return output

    def _verdict(self, answers: dict[str, torch.Tensor], primary: str) -> Optional[str]:
        peers = list(answers)
        if len(peers) == 2:
            agree = relative_difference(answers[peers[1]], answers[primary]) <= self.rtol
            return "agreed" if agree else None
        # Three answers: the odd one out is faulty.
        a, b, c = peers[0], peers[1], peers[2]
        ab = relative_difference(answers[a], answers[b]) <= self.rtol
        ac = relative_difference(answers[a], answers[c]) <= self.rtol
        bc = relative_difference(answers[b], answers[c]) <= self.rtol
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
        self.sequence.distrusted.add(liar)
        logger.error("spot check: peer %s returned wrong results for blocks %d:%d; not using it again",
                     liar, request.start, request.end)
        honest = asked[-1] if verdict == "primary_faulty" else primary
        return answers[honest]

    def _record(self, request: ForwardRequest, primary: str, asked: list[str], verdict: str) -> None:
        self.outcomes.append(SpotCheckOutcome(request.step, (request.start, request.end), primary, asked, verdict))
