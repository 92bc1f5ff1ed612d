"""Spot checks: re-execute some span computations on an independent server and compare.

Which hops are checked is drawn per client from the operating system's randomness (``os.urandom``), so a server
cannot predict which of its answers will be compared; ``ClientConfig.spot_check_seed`` makes the draws
reproducible for tests and measurements.

A check asks other holders of the hop's blocks, fastest first, until two servers agree: the first agreeing pair
is the majority, every server whose answer disagrees with it is distrusted for the rest of the session, reported
in the result and the log, and never used again by this client. The majority's answer is what the generation
continues with.

A head hop (its server answered the sampler's predictions, :mod:`swarm.diffusion.prediction`) is checkable by a
replica without the head: such a checker is asked for hidden states, which this client scores with its own final
norm and head (loaded lazily, the first time), and the predictions are compared. When only two opinions exist and
they disagree, the head server is also asked for its hidden states: if those agree with the checker's, its
predictions contradict its own hidden states and it is the liar (it cannot clear itself this way, only convict
itself).

A check that finds no majority (two servers disagree and no third opinion exists) is *unresolved*: nobody can tell
who lied, so both are avoided for the rest of the session, the outcome names both, and the hop is redone on
another route (:class:`UnresolvedCheck`); when no other route exists the generation stops with
:class:`UnverifiedResultError`. Neither answer is ever used, so a liar acting only as a checker cannot move the
route onto itself. Under a policy that requires verified tokens (the ``restricted`` tier) an unresolved check
stops the generation at once.

Reuse passes of the activation cache are checked too: the checker first receives the same fill the
checked server reused (the client keeps each hop's fill input while checks are on), then the reuse.

A *reference* (:class:`~swarm.client.reference.LocalReference`: this process's own copy of the blocks) is a trusted
checker. A client whose checkpoint holds the blocks uses it when no other server can check a hop; an auditor uses it
for every check (``reference_only``), so its verdicts never depend on another server's word. What a client's checks
may load (the blocks recomputed, the head that scores) is bounded (:mod:`swarm.client.check_memory`): a check past the
bound is left unchecked with the reason. Without a checker, the hop stays unchecked: its outcome says
``no_checker``, the request's ``result.info["unchecked"]`` counts it and the first one of a request is logged as a
warning, so no tokens are returned as checked that were not.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import threading
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NoReturn, Optional

import torch

from swarm.adapters.block import BlockAdapter
from swarm.client.check_memory import CheckMemory
from swarm.client.config import ClientConfig
from swarm.client.failover import RetriesExhausted
from swarm.client.peers import PeerHealth
from swarm.client.receipts import ReceiptBook
from swarm.client.reference import LOCAL, LocalReference
from swarm.diffusion.pipeline import CacheDirective
from swarm.diffusion.prediction import HeadQuery, exact_columns, predict_from_hidden
from swarm.utils.errors import SwarmError
from swarm.utils.event_loop import BackgroundLoop
from swarm.wire.evidence import CallEvidence
from swarm.wire.messages import ForwardRequest, RemoteError
from swarm.wire.remote import RemoteCaller

if TYPE_CHECKING:
    from swarm.models.modules import OutputHead

logger = logging.getLogger(__name__)

UNRESOLVED = "unresolved"
NO_CHECKER = "no_checker"
OWN_HIDDEN_STATES = "its predictions contradict its own hidden states"
MAX_PROOFS = 64


class UnverifiedResultError(RetriesExhausted):
    """A spot check found no majority and no other route, or no checker under a policy that accepts only verified
    results."""


class UnresolvedCheck(SwarmError):
    """Two servers disagreed on a hop with no third opinion: both are avoided now, and the hop must be redone on
    another route (raised to :class:`~swarm.client.sequence.RemoteSequence`, which does so)."""


@dataclass
class SpotCheckOutcome:
    step: int
    blocks: tuple[int, int]
    primary: str
    checkers: list[str]
    verdict: str  # "agreed", "primary_faulty", "checker_faulty", "unresolved", "no_checker"
    reuse: bool = False  # the checked call reused the activation cache
    note: str = ""  # how a verdict without a majority of servers was reached
    kind: str = "plain"  # what the checked call carried (call_kind)

    def to_dict(self) -> dict:
        return {"step": self.step, "blocks": list(self.blocks), "primary": self.primary,
                "checkers": self.checkers, "verdict": self.verdict, "reuse": self.reuse, "note": self.note,
                "kind": self.kind}


def call_kind(request: ForwardRequest) -> str:
    """What a span call carries besides hidden states, as words (``fill+head``, ``reuse+adapter``, ``plain``): the
    kinds of call a liar could single out, named in outcomes and audit reasons."""
    parts = []
    if request.cache is not None:
        parts.append("fill" if request.cache.fill else "reuse")
    if request.head is not None:
        parts.append("head")
    if request.adapter is not None:
        parts.append("adapter")
    return "+".join(parts) or "plain"


def schedule_rng(seed: Optional[int]) -> random.Random:
    """The draws of which hops to check: from ``seed`` (reproducible), or with None from ``os.urandom`` on every
    draw, so that neither a server nor another client can predict them."""
    return random.SystemRandom() if seed is None else random.Random(seed)


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
    exact = exact_columns(a)  # the token of a prediction row, the ids of a sparse answer
    return torch.equal(a[..., :exact], b[..., :exact]) and relative_difference(a[..., exact:], b[..., exact:]) <= rtol


def without_head(request: ForwardRequest) -> ForwardRequest:
    """The same call asking for hidden states instead of a head server's predictions."""
    return dataclasses.replace(request, head=None)


class FillInputs:
    """The hidden states each hop's cache fills were computed from, so a checker can rebuild the same cache.

    Keyed by (session, start, end, version); versions older than a fill's ``keep_from`` are dropped with it,
    exactly as servers drop them.
    """

    def __init__(self) -> None:
        self._inputs: dict[tuple[str, int, int, int], torch.Tensor] = {}
        self._lock = threading.Lock()  # calls in flight (stale pipelining) remember fills concurrently

    def remember(self, request: ForwardRequest) -> None:
        directive = request.cache
        with self._lock:
            for key in [k for k in self._inputs if k[0] == request.session_id and k[3] < directive.keep_from]:
                del self._inputs[key]
            self._inputs[(request.session_id, request.start, request.end, directive.version)] = request.hidden

    def lookup(self, request: ForwardRequest) -> Optional[torch.Tensor]:
        version = request.cache.version
        with self._lock:
            return self._inputs.get((request.session_id, request.start, request.end, version))

    def clear(self) -> None:
        with self._lock:
            self._inputs.clear()


Holders = Callable[[int, int, frozenset[str], bool, Optional[BlockAdapter]], list[str]]


class SpotChecker:
    """Draws which hops to check and follows the first two servers that agree (see the module doc)."""

    def __init__(self, health: PeerHealth, caller: RemoteCaller, loop: BackgroundLoop, config: ClientConfig,
                 holders: Holders):
        self.health, self.caller, self.loop, self.config = health, caller, loop, config
        self.holders = holders  # (start, end, avoid, head, adapter) -> usable holders, fastest first
        self.rtol = config.spot_check_rtol
        self.fraction = config.spot_check_fraction
        self.require_verified = False  # set by the request's policy: stop instead of returning unverified tokens
        self.rng = schedule_rng(config.spot_check_seed)
        self.outcomes: list[SpotCheckOutcome] = []
        self.fills = FillInputs()
        # The client's own final norm and head, to score a replica's hidden states for a head hop (None: only
        # head servers can check head servers).
        self.load_head: Optional[Callable[[], "OutputHead"]] = None
        self._said_scoring = False
        # A trusted recomputation of any hop (None: none); with reference_only, the only checker asked (an auditor)
        self.reference: Optional[LocalReference] = None
        self.reference_only = False
        # The weights checks may load into this client (None: no bound, as an auditor that holds every block)
        self.memory: Optional[CheckMemory] = None
        self.unchecked = 0  # hops drawn for a check that nobody could check, since the last reset (per request)
        self.receipts: Optional[ReceiptBook] = None  # the calls' receipts: a lie found on one becomes a proof
        self.proofs: list[CallEvidence] = []  # every wrong answer caught on a signed call (bounded)

    def reset(self) -> None:
        """Before a request: forget earlier generations' fill inputs and unchecked hops."""
        self.fills.clear()
        self.unchecked = 0

    def maybe_check(self, request: ForwardRequest, primary: str, output: torch.Tensor,
                    head: Optional[HeadQuery] = None) -> torch.Tensor:
        """``output`` (``primary``'s answer to ``request``: predictions when ``head`` was asked) or, when this hop
        is drawn for a check, the majority's answer."""
        if self.fraction <= 0:
            return output
        if request.cache is not None and request.cache.fill:
            self.fills.remember(request)
        if self.rng.random() >= self.fraction:
            return output
        return self.check(request, primary, output, head)

    def check(self, request: ForwardRequest, primary: str, output: torch.Tensor,
              head: Optional[HeadQuery] = None) -> torch.Tensor:
        """Ask other holders until two servers agree; the first agreeing pair wins (see the module doc). With only
        the reference, or when no other holder answers, the reference decides."""
        if self.reference is not None and self.reference_only:
            return self._against_reference(request, primary, output)
        asked: list[str] = []
        answers: dict[str, torch.Tensor] = {primary: output}
        checkers, refused = self._checkers(request, primary, head)
        for peer, holds_head in checkers:
            answer = self._answer(peer, request, head, holds_head)
            if answer is None:
                continue
            asked.append(peer)
            answers[peer] = answer
            pair = self._agreeing_pair(answers)
            if pair is not None:
                return self._conclude(request, primary, asked, answers, pair)
        if not asked:
            if self.reference is not None:
                return self._against_reference(request, primary, output)
            return self._no_checker(request, primary, output, refused)
        if head is not None:
            honest = self._contradicted_by_own_hidden_states(request, primary, head, answers)
            if honest is not None:
                return self._conclude(request, primary, asked, answers, (honest, honest), OWN_HIDDEN_STATES)
        return self._unresolved(request, primary, asked)

    def _checkers(self, request: ForwardRequest, primary: str,
                  head: Optional[HeadQuery]) -> tuple[list[tuple[str, bool]], str]:
        """Who may check, and whether each answers a head query: holders of the blocks; for a head hop head servers
        first, then (when this client can score hidden states) replicas without the head; with them, why replicas
        were left out ("" if not). Only live holders: those that answered this client's ping since their last failure
        (the route's refresh pings the others). A dead replica's record outlives it, and a check drawn every few steps
        dialled it again after each ban ran out."""
        avoid = frozenset({primary})
        with_head = self._live(self.holders(request.start, request.end, avoid, head is not None, request.adapter))
        checkers = [(peer, head is not None) for peer in with_head]
        if head is None or self.load_head is None:
            return checkers, ""
        replicas = [(peer, False) for peer in self._live(self.holders(request.start, request.end, avoid, False,
                                                                      request.adapter))
                    if peer not in with_head]
        refused = self._over_memory(None, True, "scoring a replica's hidden states with this client's head") \
            if replicas else None
        return (checkers, refused) if refused is not None else (checkers + replicas, "")

    def _over_memory(self, blocks: Optional[tuple[int, int]], head: bool, what: str) -> Optional[str]:
        """Why a check may not load ``blocks`` (and the head) into this client (None: it may; it is counted). A
        request that accepts only verified results loads what their checks need, and an auditor (``reference_only``)
        holds every block already."""
        if self.memory is None or self.require_verified or self.reference_only:
            return None
        refused = self.memory.take(blocks, head, what)
        if refused is not None:
            logger.info("spot check: %s", refused)
        return refused

    def _live(self, peers: list[str]) -> list[str]:
        return [peer for peer in peers if self.health.maybe_live(peer)]

    def _answer(self, peer: str, request: ForwardRequest, head: Optional[HeadQuery],
                holds_head: bool) -> Optional[torch.Tensor]:
        """``peer``'s answer in the primary's form (for a head hop: predictions, its own when it holds the head,
        else its hidden states scored here); None when the call failed."""
        if head is None or holds_head:
            return self._call(peer, request)
        hidden = self._call(peer, without_head(request))
        return None if hidden is None else self._score(hidden, head, peer)

    def _score(self, hidden: torch.Tensor, head: HeadQuery, peer: str) -> torch.Tensor:
        """The predictions a head server should answer for these hidden states, computed by this client's head (a
        malformed answer is returned as is: it agrees with no predictions)."""
        if hidden.dim() != 3 or hidden.shape[0] != head.batch or not hidden.shape[1] >= head.scored[1]:
            return hidden
        if not self._said_scoring:
            logger.info("checking a head server's predictions against %s's hidden states scored by this client's "
                        "own head (loaded once for spot checks)", peer[-8:])
            self._said_scoring = True
        return predict_from_hidden(self.load_head(), hidden, head)

    def _contradicted_by_own_hidden_states(self, request: ForwardRequest, primary: str, head: HeadQuery,
                                           answers: dict[str, torch.Tensor]) -> Optional[str]:
        """The checker whose predictions the head server's own hidden states give (scored here), when its answered
        predictions differ from them: then the head server contradicts itself. None otherwise (this can only
        convict the head server, never clear it: its two answers are one opinion)."""
        scorable = self.load_head is not None and self._over_memory(
            None, True, "scoring the head server's own hidden states with this client's head") is None
        own = self._answer(primary, request, head, holds_head=False) if scorable else None
        if own is None:
            return None
        return next((peer for peer, answer in answers.items()
                     if peer != primary and answers_agree(own, answer, self.rtol)), None)

    def _agreeing_pair(self, answers: dict[str, torch.Tensor]) -> Optional[tuple[str, str]]:
        """The earlier server whose answer the newest one agrees with, and the newest: two independent servers
        that computed the same. None when the newest agrees with nobody."""
        peers = list(answers)
        newest = peers[-1]
        for other in peers[:-1]:
            if answers_agree(answers[newest], answers[other], self.rtol):
                return other, newest
        return None

    def _call(self, peer: str, request: ForwardRequest) -> Optional[torch.Tensor]:
        """The checker's answer to ``request``; for a reuse pass, after the same fill. None if it failed."""
        try:
            if request.cache is None or request.cache.fill:
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
        version = request.cache.version
        session = f"check-{uuid.uuid4().hex}"
        reuse = dataclasses.replace(without_head(request), session_id=session,
                                    cache=dataclasses.replace(request.cache, keep_from=version))
        self._forward(peer, dataclasses.replace(reuse, hidden=fill_input, cache=CacheDirective(version, None, version)))
        return self._forward(peer, reuse)

    def _conclude(self, request: ForwardRequest, primary: str, asked: list[str], answers: dict[str, torch.Tensor],
                  pair: tuple[str, str], note: str = "") -> torch.Tensor:
        """Follow the agreeing ``pair``: every server whose answer disagrees with it is distrusted."""
        winner = pair[0]
        liars = [peer for peer in answers if peer not in pair]
        verdict = "agreed" if not liars else "checker_faulty" if primary in pair else "primary_faulty"
        self._record(request, primary, asked, verdict, note)
        for liar in liars:
            reason = f"spot check: returned wrong results for blocks {request.start}:{request.end}"
            self.health.distrust(liar, f"{reason} ({note})" if note else reason)
        if primary in liars:
            self._prove(request, primary)
        return answers[winner]

    def _prove(self, request: ForwardRequest, primary: str) -> None:
        """Keep the checked call, with its receipt, as a proof anyone holding the blocks can recompute."""
        call = self.receipts.for_request(request) if self.receipts is not None else None
        evidence = self.receipts.evidence(call) if call is not None and call.peer_id == primary else None
        if evidence is None:
            return
        self.proofs.append(evidence)
        del self.proofs[:-MAX_PROOFS]
        logger.warning("kept the signed wrong answer of %s as a proof (DistributedDiffusionLM.proofs)", primary)

    def _against_reference(self, request: ForwardRequest, primary: str, output: torch.Tensor) -> torch.Tensor:
        """Compare ``primary``'s answer with this process's own recomputation: a disagreement distrusts it, and the
        recomputed answer is what the generation continues with."""
        reuse = request.cache is not None and not request.cache.fill
        fill_input = self.fills.lookup(request) if reuse else None
        if reuse and fill_input is None:  # its fill went through another route (a failover): cannot rebuild it
            return self._no_checker(request, primary, output, "the reused fill went through another server")
        refused = self._over_memory(self.reference.to_load(request.start, request.end), request.head is not None,
                                    f"recomputing blocks {request.start}:{request.end}"
                                    + (" and the head" if request.head is not None else ""))
        if refused is not None:
            return self._no_checker(request, primary, output, refused)
        expected = self.reference.answer(request, fill_input)
        if answers_agree(output, expected, self.rtol):
            self._record(request, primary, [LOCAL], "agreed")
            return output
        difference = relative_difference(output, expected) if output.shape == expected.shape else float("inf")
        note = f"recomputed here: relative difference {difference:.3g} > {self.rtol:g}"
        self._record(request, primary, [LOCAL], "primary_faulty", note)
        self.health.distrust(primary, f"spot check: returned wrong results for blocks {request.start}:{request.end} "
                                      f"({note})")
        self._prove(request, primary)
        return expected

    def _no_checker(self, request: ForwardRequest, primary: str, output: torch.Tensor, note: str = "") -> torch.Tensor:
        """Nobody else can compute this hop: it stays unchecked (and says so: the outcome, ``unchecked`` and a warning
        at the request's first), unless the request needs it checked."""
        self._record(request, primary, [], NO_CHECKER, note)
        self.unchecked += 1
        if self.unchecked == 1 and not self.require_verified:
            logger.warning("spot check of blocks %d:%d (server %s) drawn, but no other usable server holds them and "
                           "this client cannot recompute them%s: this request's tokens are unchecked there "
                           "(result.info['unchecked'] counts such hops)", request.start, request.end, primary[-8:],
                           f" ({note})" if note else "")
        if self.require_verified:
            raise UnverifiedResultError(
                f"no other usable server holds blocks {request.start}:{request.end} to check {primary[-8:]} at step "
                f"{request.step}; this request accepts only verified results, so every span needs two holders it "
                "may use (for a restricted request: two trusted peers)")
        return output

    def _unresolved(self, request: ForwardRequest, primary: str, asked: list[str]) -> NoReturn:
        """No two servers agree: avoid every one of them and have the hop redone elsewhere (never trust one)."""
        self._record(request, primary, asked, UNRESOLVED)
        peers = [primary, *asked]
        what = (f"spot check of blocks {request.start}:{request.end} at step {request.step} unresolved: "
                f"{' and '.join(p[-8:] for p in peers)} disagreed and no third opinion exists")
        if self.require_verified:
            raise UnverifiedResultError(f"{what}; this request accepts only verified results")
        for peer in peers:
            self.health.dispute(peer, what)
        raise UnresolvedCheck(what)

    def _record(self, request: ForwardRequest, primary: str, asked: list[str], verdict: str, note: str = "") -> None:
        reuse = request.cache is not None and not request.cache.fill
        self.outcomes.append(SpotCheckOutcome(request.step, (request.start, request.end), primary, asked, verdict,
                                              reuse, note, call_kind(request)))
