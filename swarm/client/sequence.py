"""Running hidden states through every block of the model over the swarm, with failover.

The servers and the route come from the :class:`~swarm.client.planner.RoutePlanner`; this module runs the passes
over them. A spot check that cannot tell which of two servers lied makes the hop be redone on another route, or
stops the pass with :class:`UnverifiedResultError` when none exists.

When a server fails mid-step the step continues from the failed block over other servers, through the one
failover loop of :mod:`swarm.client.failover`: the result is the same, because a call depends on no earlier
call, except through the activation cache, whose absence on a new server is reported as a cache miss and
repaired by rebuilding the lost version.

Training goes through the same forward: asked for a ``trace``, a pass records each hop's input, and
:meth:`RemoteSequence.backward` walks those hops backwards (each server recomputes its blocks with autograd and
answers the gradient of their input), failing over to a replica holding the same blocks, or recomputing the
hop's forward over servers that hold them between them when no single one does.

A per-block adapter (:class:`~swarm.adapters.block.BlockAdapter`: (blocks, R, hidden) weights, the client's trainable
tensor: a deep prompt's vectors, a bottleneck adapter's weights or a packed LoRA) travels with each hop as the slice
of its blocks, forward and backward; a backward call then also answers the gradient of that slice. Such passes go
hop by hop (a pushed pass cannot carry per-hop slices; the tokens are the same, the pass only crosses the network
more often), with one log line per sequence.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from swarm.adapters.block import BlockAdapter
from swarm.adapters.kinds import described
from swarm.client.failover import CLIENT_FAULTS, FailoverEvent, RetryBudget, call_with_failover
from swarm.client.planner import RoutePlanner
from swarm.client.push import PushReceiver
from swarm.client.routing import MissingBlocksError, RouteHop
from swarm.client.spot_check import SpotChecker, UnresolvedCheck, UnverifiedResultError
from swarm.diffusion.pipeline import CacheDirective
from swarm.diffusion.prediction import HeadQuery, Predictions, check_predictions
from swarm.diffusion.sampler import Halted
from swarm.models.kv_cache import CacheMiss
from swarm.models.modules import OutputHead
from swarm.wire.messages import BackwardRequest, ErrorCode, ForwardRequest, PushSpec, RemoteError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HopTrace:
    """One hop of a recorded pass: the server that computed blocks ``start:end`` and the input it was sent."""

    peer_id: str
    start: int
    end: int
    inputs: torch.Tensor


@dataclass
class Pass:
    """One pass through blocks ``start:end``: what every hop's request carries besides its hidden states."""

    session_id: str
    step: int
    tokens: int  # batch x length: one block's work
    end: int
    start: int = 0
    cache: Optional[CacheDirective] = None  # the activation-cache directive, the same for every hop
    head: Optional[HeadQuery] = None  # asked of the last hop when it is a head server
    adapter: Optional[BlockAdapter] = None  # weights for every block of the model; each hop gets its slice
    trace: Optional[list[HopTrace]] = None  # each answered hop's input is appended (for backward)

    def request(self, hop: RouteHop, hidden: torch.Tensor, head: Optional[HeadQuery]) -> ForwardRequest:
        """The hop's call: ``head`` when it should answer predictions, its blocks' slice of the adapter."""
        piece = self.adapter.slice(hop.start, hop.end).detach() if self.adapter is not None else None
        return ForwardRequest(hop.start, hop.end, hidden, self.session_id, self.step, cache=self.cache, head=head,
                              adapter=piece)


class RemoteSequence:
    """The passes of one client over its route (see the module doc); ``planner`` knows the servers and the route,
    and ``health`` (shared with it) what the client knows about each peer."""

    def __init__(self, planner: RoutePlanner):
        self.planner, self.health = planner, planner.health
        self.caller, self.loop, self.config = planner.caller, planner.loop, planner.config
        self.num_blocks, self.vocab_size = planner.num_blocks, planner.vocab_size  # vocab: to check predictions
        self.failovers: list[FailoverEvent] = []
        self.spot_checker = SpotChecker(self.health, self.caller, self.loop, self.config, planner.holders)
        self.receiver: Optional[PushReceiver] = None  # set when push is enabled
        self._said_no_push = False  # the log line about deep prompts and push is written once

    def use_client_parts(self, embed: Callable[[torch.Tensor], torch.Tensor],
                         load_head: Optional[Callable[[], OutputHead]], max_positions: int) -> None:
        """The client's embedding (challenges look like real passes) and its head, loaded when first needed (spot
        checks score a replica's hidden states to check a head server's predictions; None: only head servers
        check head servers)."""
        self.planner.embed, self.planner.max_positions = embed, max_positions
        self.spot_checker.load_head = load_head

    @property
    def distrusted(self) -> frozenset[str]:
        return self.health.distrusted

    def apply_policy(self, spot_check_fraction: float, allowed: Optional[frozenset[str]],
                     require_verified: bool = False) -> None:
        """A request's safety policy: how many hops to spot-check, which peers may serve (None: any), and
        whether an unresolved check stops the generation. Called before each generation."""
        self.spot_checker.fraction = spot_check_fraction
        self.spot_checker.require_verified = require_verified
        self.spot_checker.reset()  # fill inputs of earlier generations are never reused
        self.allow_only(allowed)

    def allow_only(self, peers: Optional[frozenset[str]]) -> None:
        """Only ``peers`` may serve from now on (None: any); a changed set drops the route, rebuilt under it."""
        if self.health.allow_only(peers):
            self.planner.route = []

    # ----- one pass through all blocks -------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, session_id: Optional[str] = None, step: int = -1,
                cache: Optional[CacheDirective] = None, head: Optional[HeadQuery] = None,
                trace: Optional[list[HopTrace]] = None, adapter: Optional[BlockAdapter] = None
                ) -> torch.Tensor | Predictions:
        """Hidden states after every block, retrying failed hops elsewhere within the configured bounds.

        ``cache`` travels with every hop (the activation-cache directive). A hop without the session's cache
        raises :class:`CacheMiss`. With ``ClientConfig.push`` the pass is first tried as one pushed chain.
        With a ``head`` query, a last hop on a head server answers its :class:`Predictions` instead (any other
        last hop, e.g. after a failover to a server without the head, answers hidden states as usual).
        With a ``trace`` list, each hop's input is appended to it (for :meth:`backward`); such a pass goes hop
        by hop, as spot-checked ones do. With a per-block ``adapter`` (weights for every block), each hop carries its
        blocks' slice, and the pass goes hop by hop.
        """
        tokens = hidden.shape[0] * hidden.shape[1]
        if session_id is None:  # a one-off pass; generations refresh between their sessions
            self.planner.refresh_if_stale(tokens)
        if adapter is not None and (adapter.weights.dim() != 3 or adapter.blocks != self.num_blocks):
            raise ValueError(f"a {adapter.kind} for this model has shape ({self.num_blocks}, R, hidden), got "
                             f"{tuple(adapter.weights.shape)}")
        run = Pass(session_id or uuid.uuid4().hex, step, tokens, self.num_blocks, cache=cache, head=head,
                   adapter=adapter, trace=trace)
        if self.receiver is not None and adapter is not None and not self._said_no_push:
            logger.info("push is off for passes with a %s (each hop carries its own blocks' slice): they go hop by "
                        "hop, with the same tokens", described(adapter.kind))
            self._said_no_push = True
        if self.receiver is not None and self.spot_checker.fraction == 0 and trace is None and adapter is None:
            pushed = self._try_push(hidden, run)
            if pushed is not None:
                return pushed
        return self._hop_by_hop(hidden, run)

    def _hop_by_hop(self, hidden: torch.Tensor, run: Pass) -> torch.Tensor | Predictions:
        """Each hop of the route in turn (blocks ``run.start:run.end``); a failed hop is redone from its first
        block on another server."""
        budget = RetryBudget(self.config)
        block = run.start
        disputed: Optional[UnresolvedCheck] = None
        while block < run.end:
            try:
                hidden, block = call_with_failover(
                    lambda avoid: self.planner.next_hop(block, run.tokens, avoid, budget, run.end, run.adapter),
                    lambda hop: hop.peer_id,
                    lambda hop: self._call_hop(hop, hidden, run),
                    health=self.health, budget=budget, final=lambda error: self._final_error(error, run.step),
                    on_failure=lambda hop, error: self.failovers.append(FailoverEvent(hop.peer_id, hop.start,
                                                                                      str(error))),
                    label=lambda hop: f"block {hop.start}",
                )
            except UnresolvedCheck as dispute:  # both sides are avoided now: redo the hop on another route
                logger.warning("%s: redoing blocks from %d on another route", dispute, block)
                disputed = dispute
            except MissingBlocksError as missing:
                if disputed is None:
                    raise
                raise UnverifiedResultError(f"{disputed}, and no other route is left ({missing})") from None
        return hidden

    def _call_hop(self, hop: RouteHop, hidden: torch.Tensor, run: Pass) -> tuple[torch.Tensor | Predictions, int]:
        """One server's blocks: its output (spot-checked when drawn) and the block the next hop starts at."""
        head = self._head_for(hop, run.head)
        request = run.request(hop, hidden, head)
        work = request.rows * (hop.end - hop.start)
        started = time.perf_counter()
        timeout = self.health.timeout(hop.peer_id, work)  # before this call joins the peer's queue
        with self.health.calling(hop.peer_id, work):
            output = self.loop.run(self.caller.forward(hop.peer_id, request, timeout))
        output = self._as_output(output, head, hop.peer_id)  # before the success is recorded
        self.health.record_success(hop.peer_id, time.perf_counter() - started, work)
        # A server announcing other numerics (allow_approximate) is not checked: exact answers always differ from its
        exact = hop.peer_id not in self.planner.approximate_peers()
        if exact and isinstance(output, Predictions):
            output = Predictions(self.spot_checker.maybe_check(request, hop.peer_id, output.rows, head), head,
                                 self.vocab_size)
        elif exact:
            output = self.spot_checker.maybe_check(request, hop.peer_id, output)
        if run.trace is not None:  # only a checked (or unchecked) answer: a disputed hop is redone, traced once
            run.trace.append(HopTrace(hop.peer_id, hop.start, hop.end, hidden))
        return output, hop.end

    def _head_for(self, hop: RouteHop, head: Optional[HeadQuery]) -> Optional[HeadQuery]:
        """``head`` for a last hop on a head server; None when the hop answers hidden states."""
        record = self.planner.servers.get(hop.peer_id)
        if head is None or hop.end != self.num_blocks or record is None or not record.head:
            return None
        return head

    def _as_output(self, output: torch.Tensor, asked: Optional[HeadQuery], peer_id: str) -> torch.Tensor | Predictions:
        """A hop's answer as the pass's output: checked predictions when it was ``asked`` for them."""
        if asked is None:
            return output
        problem = check_predictions(output, asked, self.vocab_size)
        if problem is not None:
            raise RemoteError(ErrorCode.INTERNAL, f"head server answered {problem}", peer_id)
        return Predictions(output, asked, self.vocab_size)

    @staticmethod
    def _final_error(error: RemoteError, step: int) -> Optional[BaseException]:
        """What to raise for an error no other server can fix (a missing cache, a governance halt, a bad
        request); None for one that another server may not have."""
        if error.code == ErrorCode.CACHE_MISS:
            return CacheMiss(error.message)
        if error.code == ErrorCode.HALTED:  # a server obeys a governance halt this client has not seen
            return Halted(step, error.message, {"peer": error.peer_id})
        if error.code in CLIENT_FAULTS:
            return error
        return None

    # ----- one pushed pass -------------------------------------------------------------------------
    def _try_push(self, hidden: torch.Tensor, run: Pass) -> Optional[torch.Tensor | Predictions]:
        """One pushed pass over the whole route, or None when it failed and the hop-by-hop path should run."""
        route = self.planner.full_route(run.tokens)
        head = self._head_for(route[-1], run.head)
        try:
            output = self.loop.run(self._pushed_pass(route, hidden, run, head))
        except RemoteError as error:
            fatal = self._final_error(error, run.step)
            if fatal is not None:
                raise fatal from None
            logger.warning("pushed pass failed (%s): continuing hop by hop", error)
            return None
        except asyncio.TimeoutError:
            logger.warning("pushed pass got no delivery in time: continuing hop by hop")
            return None
        expected = hidden.shape if head is None else head.output_shape
        if tuple(output.shape) != tuple(expected):
            logger.warning("pushed pass returned shape %s, expected %s: continuing hop by hop",
                           tuple(output.shape), tuple(expected))
            return None
        try:
            return self._as_output(output, head, route[-1].peer_id)
        except RemoteError as error:
            logger.warning("pushed pass: %s: continuing hop by hop", error)
            return None

    async def _pushed_pass(self, route: list[RouteHop], hidden: torch.Tensor, run: Pass,
                           head: Optional[HeadQuery]) -> torch.Tensor:
        push_id = uuid.uuid4().hex
        delivery = self.receiver.expect(push_id)
        try:
            spec = PushSpec(tuple((hop.peer_id, hop.start, hop.end) for hop in route[1:]), self.receiver.peer_id,
                            self.receiver.namespace, push_id, (self.caller.latency, self.caller.jitter))
            request = dataclasses.replace(run.request(route[0], hidden, head), push=spec)
            works = [run.tokens * (hop.end - hop.start) for hop in route]
            timeouts = [self.health.timeout(hop.peer_id, work) for hop, work in zip(route, works)]
            with contextlib.ExitStack() as queued:
                for hop, work in zip(route, works):
                    queued.enter_context(self.health.calling(hop.peer_id, work))
                await self.caller.push(route[0].peer_id, request, timeouts[0])
                return await asyncio.wait_for(delivery, sum(timeouts))
        finally:
            self.receiver.forget(push_id)

    # ----- backward --------------------------------------------------------------------------------
    def backward(self, trace: list[HopTrace], grad: torch.Tensor) -> torch.Tensor:
        """The gradient of a recorded pass's input (float32), from the gradient of its output: each hop's server
        (or a replica holding its blocks) recomputes its blocks with autograd, last hop first."""
        return self.backward_all(trace, grad)[0]

    def backward_all(self, trace: list[HopTrace], grad: torch.Tensor, adapter: Optional[BlockAdapter] = None
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """:meth:`backward`, and with the pass's per-block ``adapter`` the gradient of its weights too (float32,
        their shape), each hop's server answering its blocks' slice."""
        grad_weights = None if adapter is None else torch.zeros(adapter.weights.shape, dtype=torch.float32)
        for hop in reversed(trace):
            grad = self._backward_hop(hop, grad, adapter, grad_weights)
        return grad, grad_weights

    def _backward_hop(self, hop: HopTrace, grad: torch.Tensor, adapter: Optional[BlockAdapter] = None,
                      grad_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The gradient of the hop's input; the gradient of its blocks' slice of ``adapter`` goes into
        ``grad_weights``."""
        budget = RetryBudget(self.config)
        piece = adapter.slice(hop.start, hop.end) if adapter is not None else None
        request = BackwardRequest(hop.start, hop.end, hop.inputs, grad, uuid.uuid4().hex, adapter=piece)
        computed = RouteHop(hop.peer_id, hop.start, hop.end)
        try:
            grad_input, grad_piece = call_with_failover(
                lambda avoid: self.planner.backward_peer(computed, avoid, adapter),
                lambda peer: peer,
                lambda peer: self._call_backward(peer, request),
                health=self.health, budget=budget,
                final=lambda error: error if error.code in CLIENT_FAULTS else None,
                on_failure=lambda peer, error: self.failovers.append(FailoverEvent(peer, hop.start, str(error))),
                label=lambda peer: f"backward of block {hop.start}",
            )
        except MissingBlocksError:  # no single usable server holds the hop's blocks now: split it
            logger.info("no server holds blocks %d:%d for backward: recomputing them over several", hop.start, hop.end)
            split: list[HopTrace] = []
            tokens = hop.inputs.shape[0] * hop.inputs.shape[1]
            self._hop_by_hop(hop.inputs, Pass(uuid.uuid4().hex, -1, tokens, hop.end, hop.start, adapter=adapter,
                                              trace=split))
            if len(split) == 1 and split[0].start == hop.start and split[0].end == hop.end:
                raise
            for part in reversed(split):
                grad = self._backward_hop(part, grad, adapter, grad_weights)
            return grad
        if grad_weights is not None:
            grad_weights[hop.start:hop.end] = grad_piece
        return grad_input

    def _call_backward(self, peer_id: str, request: BackwardRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        work = 3 * request.inputs.shape[0] * request.inputs.shape[1] * (request.end - request.start)
        started = time.perf_counter()
        grads = self.loop.run(self.caller.backward_all(peer_id, request, self.health.timeout(peer_id, work)))
        self.health.record_success(peer_id, time.perf_counter() - started, work)
        return grads
