"""Running hidden states through every block of the model over the swarm, with failover.

Keeps the list of servers read from the DHT and the current route; what the client knows about each peer
(bans, round trips, speeds, distrust) lives in :class:`~swarm.client.peers.PeerHealth`. Before a server is
routed to, it must answer a compute challenge through the span it announces, shaped like a real pass (a length
drawn like real requests', embeddings of random tokens, a plausible step), so a fake server costs one short
timeout and a server cannot answer challenges and stall real calls by telling them apart by size. The challenge
proves that the server computes a real-sized pass in time; whether it computes it *right* is the spot checks'
job (:mod:`swarm.client.spot_check`). A spot check that cannot tell which of two servers lied makes the hop be
redone on another route, or stops the pass with :class:`UnverifiedResultError` when none exists.

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
import logging
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from hivemind.dht import DHT

from swarm.adapters.block import BlockAdapter
from swarm.adapters.kinds import described
from swarm.client.config import ClientConfig
from swarm.client.failover import CLIENT_FAULTS, FailoverEvent, RetryBudget, call_with_failover
from swarm.client.peers import PeerHealth
from swarm.client.push import PushReceiver
from swarm.client.routing import MissingBlocksError, RouteHop, find_route
from swarm.client.spot_check import SpotChecker, UnresolvedCheck, UnverifiedResultError
from swarm.dht.schema import ServerRecord, ServerState, read_servers
from swarm.diffusion.prediction import HeadQuery, Predictions, check_predictions
from swarm.diffusion.sampler import Halted
from swarm.models.kv_cache import CacheMiss
from swarm.models.modules import OutputHead
from swarm.protocol import BackwardRequest, ErrorCode, ForwardRequest, RemoteError
from swarm.remote import RemoteCaller
from swarm.utils.event_loop import BackgroundLoop

logger = logging.getLogger(__name__)

# Rows of a compute challenge, drawn uniformly: the lengths of real requests (a prompt and 16-128 generated
# tokens), capped by the model's positions.
CHALLENGE_ROWS = (16, 192)
CHALLENGE_STEPS = 64  # a challenge carries a step drawn below this, like a generation's call

@dataclass(frozen=True)
class HopTrace:
    """One hop of a recorded pass: the server that computed blocks ``start:end`` and the input it was sent."""

    peer_id: str
    start: int
    end: int
    inputs: torch.Tensor


def adapter_requirement(adapter: Optional[BlockAdapter]) -> str:
    """What a server must also do for a pass with a per-block ``adapter`` (for error messages)."""
    return f"applies {described(adapter.kind)} adapters" if adapter is not None else ""


class RemoteSequence:
    """The route through the swarm's servers for one client, and the passes over it (see the module doc).

    What the client knows about each peer lives in ``health`` (a :class:`PeerHealth`), shared with the
    expert queries and the spot checks.
    """

    def __init__(self, dht: DHT, caller: RemoteCaller, loop: BackgroundLoop, prefix: str, num_blocks: int,
                 hidden_size: int, config: ClientConfig, vocab_size: int = 0):
        self.dht, self.caller, self.loop = dht, caller, loop
        self.prefix, self.num_blocks, self.hidden_size, self.config = prefix, num_blocks, hidden_size, config
        self.vocab_size = vocab_size  # to check a head server's predicted token ids
        self.health = PeerHealth(config)
        self.servers: dict[str, ServerRecord] = {}
        self.route: list[RouteHop] = []
        self.failovers: list[FailoverEvent] = []
        self.spot_checker = SpotChecker(self.health, caller, loop, config, self.holders)
        self._refreshed_at = 0.0
        self._route_lock = threading.RLock()  # calls in flight (stale pipelining) share the route
        self.receiver: Optional[PushReceiver] = None  # set when push is enabled
        self._said_no_push = False  # the log line about deep prompts and push is written once
        # Real-looking challenge inputs: the client's embedding of token ids (None: Gaussian hidden states)
        self.embed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.max_positions = CHALLENGE_ROWS[1]
        self._challenge_rng = random.SystemRandom()  # a server cannot predict a challenge's size or content

    def use_client_parts(self, embed: Callable[[torch.Tensor], torch.Tensor],
                         load_head: Optional[Callable[[], OutputHead]], max_positions: int) -> None:
        """The client's embedding (challenges look like real passes) and its head, loaded when first needed (spot
        checks score a replica's hidden states to check a head server's predictions; None: only head servers
        check head servers)."""
        self.embed, self.max_positions = embed, max_positions
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
        self.spot_checker.fills.clear()  # fill inputs of earlier generations are never reused
        if self.health.allow_only(allowed):
            self.route = []  # rebuilt under the new policy

    # ----- servers and route ----------------------------------------------------------------------
    def excluded(self, also: frozenset[str] = frozenset(), adapter: Optional[BlockAdapter] = None) -> frozenset[str]:
        """Peers a route may not use now: per :class:`PeerHealth`, plus ``also`` (failed within this call), plus
        servers that do not list the kind of ``adapter`` (a pass with a per-block adapter), plus servers announcing
        approximate numerics unless ``ClientConfig.allow_approximate``. Read from the records known now, so a
        server found by a refresh during the pass is judged too."""
        excluded = self.health.excluded(self.servers) | also | self.not_applying(adapter)
        return excluded if self.config.allow_approximate else excluded | self.approximate_peers()

    def approximate_peers(self) -> frozenset[str]:
        """Known servers whose records say their numerics differ from the checkpoint's."""
        return frozenset(peer for peer, record in self.servers.items() if record.approximate)

    def not_applying(self, adapter: Optional[BlockAdapter]) -> frozenset[str]:
        """Known servers whose records do not say they apply per-block adapters of ``adapter``'s kind (none when
        ``adapter`` is None: a pass without one). A server that predates the record field could misapply one
        silently."""
        if adapter is None:
            return frozenset()
        return frozenset(peer for peer, record in self.servers.items() if adapter.kind not in record.adapter_kinds)

    def holders(self, start: int, end: int, avoid: frozenset[str] = frozenset(), head: bool = False,
                adapter: Optional[BlockAdapter] = None) -> list[str]:
        """Usable online servers holding blocks ``start:end`` (and the output head, with ``head``; applying
        ``adapter``'s kind, when given), fastest first (spot checks ask these)."""
        excluded = self.excluded(avoid, adapter)
        found = [peer for peer, record in self.servers.items()
                 if record.state == ServerState.ONLINE and peer not in excluded
                 and record.start <= start and end <= record.end and (record.head or not head)]
        latencies = self.health.latencies()
        return sorted(found, key=lambda peer: (latencies.get(peer, float("inf")), peer))

    def refresh(self) -> None:
        """Re-read servers from the DHT and ping (with a compute challenge) those not measured yet."""
        previous, self.servers = self.servers, read_servers(self.dht, self.prefix, self.num_blocks)
        for peer, record in self.servers.items():
            if peer in previous and record.addresses and record.addresses != previous[peer].addresses:
                self.health.forgive(peer, f"it now announces {', '.join(record.addresses)}")
        self._ping_unmeasured()
        self._refreshed_at = time.monotonic()
        logger.info("%d servers known for %s (%d online)", len(self.servers), self.prefix,
                    sum(r.state == ServerState.ONLINE for r in self.servers.values()))

    def _ping_unmeasured(self) -> None:
        """Challenge every usable online server this client has no measurement of, all at once.

        A peer that does not answer, serves another model, or cannot compute the span it announces within
        ``connect_timeout`` is banned before any route uses it: a fake server costs one short timeout, in
        parallel with the others, instead of a request timeout per call.
        """
        excluded = self.excluded()
        peers = [p for p, r in self.servers.items() if r.state == ServerState.ONLINE and p not in excluded
                 and not self.health.measured(p)]
        if not peers:
            return
        results = self.loop.run(self._challenge_all(peers))
        for peer_id, outcome in zip(peers, results):
            if isinstance(outcome, BaseException):
                stalled = isinstance(outcome, RemoteError) and outcome.code == ErrorCode.TIMEOUT
                self.health.record_failure(peer_id, f"failed its ping: {outcome}", stalled=stalled)

    async def _challenge_all(self, peers: list[str]) -> list:
        return await asyncio.gather(*(self._challenge(p) for p in peers), return_exceptions=True)

    async def _challenge(self, peer_id: str) -> None:
        """Ask for the server's description, then for one token through the whole span it announces.

        A server that answers ``busy`` or ``halted`` is alive and holds the span: it passes, unmeasured (its
        first call gets the full request timeout), and a halt then ends the generation as usual.
        """
        record = self.servers[peer_id]
        try:
            info, rtt = await self.caller.info(peer_id, self.config.connect_timeout)
        except RemoteError as error:  # the daemon may know only an address the server no longer listens on
            if error.code != ErrorCode.UNREACHABLE or not record.addresses:
                raise
            await self.caller.connect(peer_id, record.addresses, self.config.connect_timeout)
            info, rtt = await self.caller.info(peer_id, self.config.connect_timeout)
        if info.get("prefix") != self.prefix:
            raise RemoteError(ErrorCode.WRONG_SPAN, f"serves {info.get('prefix')!r}, not {self.prefix!r}", peer_id)
        request = self.challenge_request(record.start, record.end)
        work = request.rows * (record.end - record.start)
        started = time.perf_counter()
        try:
            output = await self.caller.forward(peer_id, request, self.challenge_timeout(record, request.rows))
        except RemoteError as error:
            if error.code in (ErrorCode.BUSY, ErrorCode.HALTED):
                self.health.record_ping(peer_id, rtt)
                return
            raise RemoteError(error.code, f"compute challenge over {record.start}:{record.end}: {error.message}",
                              peer_id) from None
        if tuple(output.shape) != tuple(request.hidden.shape) or not bool(torch.isfinite(output).all()):
            raise RemoteError(ErrorCode.INTERNAL, f"answered its compute challenge with {tuple(output.shape)} "
                              "values (or non-finite ones)", peer_id)
        self.health.record_ping(peer_id, rtt)
        self.health.record_success(peer_id, time.perf_counter() - started, work)

    def challenge_request(self, start: int, end: int) -> ForwardRequest:
        """A forward call through blocks ``start:end`` that a server cannot tell from a real uncached pass: a length
        drawn like real requests', the embeddings of random tokens, a step drawn like a generation's and a fresh
        session (only a client's later calls could tell it apart, and it has none)."""
        rng = self._challenge_rng
        low, high = CHALLENGE_ROWS
        length = rng.randint(min(low, self.max_positions), min(high, self.max_positions))
        if self.embed is not None and self.vocab_size > 0:
            ids = torch.tensor([[rng.randrange(self.vocab_size) for _ in range(length)]])
            with torch.no_grad():
                hidden = self.embed(ids)
        else:
            hidden = torch.randn(1, length, self.hidden_size)
        return ForwardRequest(start, end, hidden, uuid.uuid4().hex, rng.randrange(CHALLENGE_STEPS), {})

    def challenge_timeout(self, record: ServerRecord, rows: int) -> float:
        """How long a challenge of ``rows`` may take: ``connect_timeout``, plus what the server's announced
        throughput predicts for the rows (a slow honest server is not failed; a fake announcing a huge
        throughput gets about ``connect_timeout``), at most ``request_timeout``."""
        compute = rows / max(record.throughput, 1e-3)
        return min(self.config.request_timeout, self.config.connect_timeout + self.config.timeout_factor * compute)

    def build_route(self, start_block: int = 0, tokens: int = 128, avoid: frozenset[str] = frozenset(),
                    adapter: Optional[BlockAdapter] = None) -> list[RouteHop]:
        """The cheapest chain from ``start_block`` to the end, avoiding ``avoid`` as well as unusable peers (and,
        for a pass with a per-block ``adapter``, servers that do not apply its kind)."""
        with self._route_lock:
            if self._servers_stale() or not self.servers:
                self.refresh()
            else:
                self._ping_unmeasured()  # peers whose ban ran out are challenged again before use
            try:
                tail = self._find(start_block, tokens, avoid, adapter)
            except MissingBlocksError:
                self.refresh()  # the DHT may know servers that joined since the last read
                tail = self._find(start_block, tokens, avoid, adapter)
            self.route = [hop for hop in self.route if hop.end <= start_block] + tail
            logger.info("route: %s", " -> ".join(map(str, self.route)))
            return self.route

    def _find(self, start_block: int, tokens: int, avoid: frozenset[str],
              adapter: Optional[BlockAdapter] = None) -> list[RouteHop]:
        """The cheapest route, ending on a head server when one is usable (``ClientConfig.head`` "auto")."""
        excluded, latencies = self.excluded(avoid, adapter), self.health.latencies()
        heads = self.head_servers(excluded)
        if heads:
            try:
                return find_route(self.servers, self.num_blocks, start_block, latencies, excluded, tokens,
                                  finishers=heads)
            except MissingBlocksError:
                pass  # the head servers cannot be reached: end anywhere, the client computes the head
        return find_route(self.servers, self.num_blocks, start_block, latencies, excluded, tokens)

    def head_servers(self, excluded: frozenset[str] = frozenset()) -> frozenset[str]:
        """Usable servers that answer head queries (none when the client keeps the head: ``head="client"``)."""
        if self.config.head != "auto":
            return frozenset()
        return frozenset(peer for peer, record in self.servers.items() if record.head and peer not in excluded
                         and record.end == self.num_blocks and record.state == ServerState.ONLINE)

    def refresh_if_stale(self, tokens: int = 128) -> None:
        """Re-read the servers and rebuild the route when the last read is older than ``route_refresh``.

        Called before a generation, never during one: a route changed mid-generation (a server that joined,
        or a cost that shifted with the call size) would lose the servers' activation caches for nothing.
        A broken hop is still replaced at once (:meth:`hop_from`).
        """
        if self._servers_stale():
            self.build_route(0, tokens)

    def _servers_stale(self) -> bool:
        return time.monotonic() - self._refreshed_at > self.config.route_refresh

    def hop_from(self, block: int, tokens: int, avoid: frozenset[str] = frozenset(),
                 adapter: Optional[BlockAdapter] = None) -> RouteHop:
        excluded = self.excluded(avoid, adapter)
        for hop in self.route:
            if hop.start == block and hop.peer_id not in excluded:
                return hop
        route = self.build_route(block, tokens, avoid, adapter)
        return next(hop for hop in route if hop.start == block)

    def full_route(self, tokens: int) -> list[RouteHop]:
        """The current route when every hop is usable and it covers every block, else a rebuilt one."""
        route, excluded = list(self.route), self.excluded()
        if not route or route[-1].end != self.num_blocks or any(hop.peer_id in excluded for hop in route):
            route = list(self.build_route(0, tokens))
        return route

    # ----- one pass through all blocks -------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, session_id: Optional[str] = None, step: int = -1,
                extra: Optional[dict] = None, head: Optional[HeadQuery] = None,
                trace: Optional[list[HopTrace]] = None, adapter: Optional[BlockAdapter] = None
                ) -> torch.Tensor | Predictions:
        """Hidden states after every block, retrying failed hops elsewhere within the configured bounds.

        ``extra`` travels with every hop (the activation-cache directive). A hop without the session's cache
        raises :class:`CacheMiss`. With ``ClientConfig.push`` the pass is first tried as one pushed chain.
        With a ``head`` query, a last hop on a head server answers its :class:`Predictions` instead (any other
        last hop, e.g. after a failover to a server without the head, answers hidden states as usual).
        With a ``trace`` list, each hop's input is appended to it (for :meth:`backward`); such a pass goes hop
        by hop, as spot-checked ones do. With a per-block ``adapter`` (weights for every block), each hop carries its
        blocks' slice, and the pass goes hop by hop.
        """
        extra = dict(extra or {})
        tokens = hidden.shape[0] * hidden.shape[1]
        if session_id is None:  # a one-off pass; generations refresh between their sessions
            self.refresh_if_stale(tokens)
        session_id = session_id or uuid.uuid4().hex
        if adapter is not None and (adapter.weights.dim() != 3 or adapter.blocks != self.num_blocks):
            raise ValueError(f"a {adapter.kind} for this model has shape ({self.num_blocks}, R, hidden), got "
                             f"{tuple(adapter.weights.shape)}")
        if self.receiver is not None and adapter is not None and not self._said_no_push:
            logger.info("push is off for passes with a %s (each hop carries its own blocks' slice): they go hop by "
                        "hop, with the same tokens", described(adapter.kind))
            self._said_no_push = True
        if self.receiver is not None and self.spot_checker.fraction == 0 and trace is None and adapter is None:
            pushed = self._try_push(hidden, session_id, step, extra, tokens, head)
            if pushed is not None:
                return pushed
        return self._hop_by_hop(hidden, session_id, step, extra, tokens, head, trace, adapter=adapter)

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
        try:
            grad_input, grad_piece = call_with_failover(
                lambda avoid: self._backward_peer(hop, avoid, adapter),
                lambda peer: peer,
                lambda peer: self._call_backward(peer, request),
                health=self.health, budget=budget,
                final=lambda error: error if error.code in CLIENT_FAULTS else None,
                on_failure=lambda peer, error: self.failovers.append(FailoverEvent(peer, hop.start, str(error))),
                label=lambda peer: f"backward of block {hop.start}",
            )
        except MissingBlocksError:  # no single usable server holds the hop's blocks now: split it
            logger.info("no server holds blocks %d:%d for backward: recomputing them over several", hop.start, hop.end)
            tokens = hop.inputs.shape[0] * hop.inputs.shape[1]
            split: list[HopTrace] = []
            self._hop_by_hop(hop.inputs, uuid.uuid4().hex, -1, {}, tokens, None, split, hop.start, hop.end, adapter)
            if len(split) == 1 and split[0].start == hop.start and split[0].end == hop.end:
                raise
            for part in reversed(split):
                grad = self._backward_hop(part, grad, adapter, grad_weights)
            return grad
        if grad_weights is not None:
            grad_weights[hop.start:hop.end] = grad_piece
        return grad_input

    def _backward_peer(self, hop: HopTrace, avoid: frozenset[str], adapter: Optional[BlockAdapter] = None) -> str:
        """The server that computed the hop, else the fastest usable one holding all its blocks."""
        if hop.peer_id not in self.excluded(avoid, adapter):
            return hop.peer_id
        holders = self.holders(hop.start, hop.end, avoid, adapter=adapter)
        if not holders:
            self.refresh()
            holders = self.holders(hop.start, hop.end, avoid, adapter=adapter)
        if not holders:
            raise MissingBlocksError(list(range(hop.start, hop.end)), requirement=adapter_requirement(adapter))
        return holders[0]

    def _call_backward(self, peer_id: str, request: BackwardRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        work = 3 * request.inputs.shape[0] * request.inputs.shape[1] * (request.end - request.start)
        started = time.perf_counter()
        grads = self.loop.run(self.caller.backward_all(peer_id, request, self.health.timeout(peer_id, work)))
        self.health.record_success(peer_id, time.perf_counter() - started, work)
        return grads

    def _head_extra(self, hop: RouteHop, extra: dict, head: Optional[HeadQuery]) -> Optional[dict]:
        """``extra`` with the head query, for a last hop on a head server; None when the hop answers hidden states."""
        record = self.servers.get(hop.peer_id)
        if head is None or hop.end != self.num_blocks or record is None or not record.head:
            return None
        return dict(extra, head=head.to_dict())

    def _as_output(self, output: torch.Tensor, head_extra: Optional[dict], head: Optional[HeadQuery],
                   peer_id: str) -> torch.Tensor | Predictions:
        """A hop's answer as the pass's output: checked predictions when it was asked for them."""
        if head_extra is None:
            return output
        problem = check_predictions(output, head, self.vocab_size)
        if problem is not None:
            raise RemoteError(ErrorCode.INTERNAL, f"head server answered {problem}", peer_id)
        return Predictions(output, head)

    def _try_push(self, hidden: torch.Tensor, session_id: str, step: int, extra: dict,
                  tokens: int, head: Optional[HeadQuery]) -> Optional[torch.Tensor | Predictions]:
        """One pushed pass over the whole route, or None when it failed and the hop-by-hop path should run."""
        route = self.full_route(tokens)
        head_extra = self._head_extra(route[-1], extra, head)
        if head_extra is not None:
            extra = head_extra
        try:
            output = self.loop.run(self._pushed_pass(route, hidden, session_id, step, extra, tokens))
        except RemoteError as error:
            fatal = self._final_error(error, step)
            if fatal is not None:
                raise fatal from None
            logger.warning("pushed pass failed (%s): continuing hop by hop", error)
            return None
        except asyncio.TimeoutError:
            logger.warning("pushed pass got no delivery in time: continuing hop by hop")
            return None
        expected = hidden.shape if head_extra is None else head.output_shape
        if tuple(output.shape) != tuple(expected):
            logger.warning("pushed pass returned shape %s, expected %s: continuing hop by hop",
                           tuple(output.shape), tuple(expected))
            return None
        try:
            return self._as_output(output, head_extra, head, route[-1].peer_id)
        except RemoteError as error:
            logger.warning("pushed pass: %s: continuing hop by hop", error)
            return None

    async def _pushed_pass(self, route: list[RouteHop], hidden: torch.Tensor, session_id: str, step: int,
                           extra: dict, tokens: int) -> torch.Tensor:
        push_id = uuid.uuid4().hex
        delivery = self.receiver.expect(push_id)
        try:
            first = route[0]
            spec = {"route": [[hop.peer_id, hop.start, hop.end] for hop in route[1:]],
                    "reply_to": self.receiver.peer_id,
                    "namespace": self.receiver.namespace, "id": push_id,
                    "hop_delay": [self.caller.latency, self.caller.jitter]}
            request = ForwardRequest(first.start, first.end, hidden, session_id, step, dict(extra, push=spec))
            timeouts = [self.health.timeout(hop.peer_id, tokens * (hop.end - hop.start)) for hop in route]
            await self.caller.push(first.peer_id, request, timeouts[0])
            return await asyncio.wait_for(delivery, min(sum(timeouts), self.config.request_timeout))
        finally:
            self.receiver.forget(push_id)

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

    def _hop_by_hop(self, hidden: torch.Tensor, session_id: str, step: int, extra: dict, tokens: int,
                    head: Optional[HeadQuery] = None, trace: Optional[list[HopTrace]] = None,
                    start: int = 0, end: Optional[int] = None, adapter: Optional[BlockAdapter] = None
                    ) -> torch.Tensor | Predictions:
        """Each hop of the route in turn (blocks ``start:end``, by default all); a failed hop is redone from its
        first block on another server. Each answered hop's input is appended to ``trace`` when given. ``adapter``
        holds a per-block adapter's weights for every block of the model; each hop is sent its blocks' slice."""
        budget = RetryBudget(self.config)
        block, end = start, self.num_blocks if end is None else end
        disputed: Optional[UnresolvedCheck] = None
        while block < end:
            try:
                hidden, block = call_with_failover(
                    lambda avoid: self._next_hop(block, tokens, avoid, budget, end, adapter),
                    lambda hop: hop.peer_id,
                    lambda hop: self._call_hop(hop, hidden, session_id, step, extra, head, trace, adapter),
                    health=self.health, budget=budget, final=lambda error: self._final_error(error, step),
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

    def _next_hop(self, block: int, tokens: int, avoid: frozenset[str], budget: RetryBudget,
                  end: Optional[int] = None, adapter: Optional[BlockAdapter] = None) -> RouteHop:
        """The hop from ``block`` (cut at ``end``); when no usable server covers the rest, wait for a busy one or
        say which blocks are missing (for a pass with a per-block adapter: among servers that apply its kind) and
        what was tried."""
        while True:
            try:
                hop = self.hop_from(block, tokens, avoid, adapter)
                return hop if end is None or hop.end <= end else RouteHop(hop.peer_id, hop.start, end)
            except MissingBlocksError as error:
                pause = self.health.wait_for_busy()
                if pause is None:
                    raise MissingBlocksError(error.blocks, list(budget.errors) or None,
                                             adapter_requirement(adapter)) from None
                budget.wait(str(error), pause or None, where=f" at block {block}")  # 0: the usual back-off

    def _call_hop(self, hop: RouteHop, hidden: torch.Tensor, session_id: str, step: int, extra: dict,
                  head: Optional[HeadQuery] = None, trace: Optional[list[HopTrace]] = None,
                  adapter: Optional[BlockAdapter] = None) -> tuple[torch.Tensor | Predictions, int]:
        """One server's blocks: its output (spot-checked when drawn) and the block the next hop starts at."""
        head_extra = self._head_extra(hop, extra, head)
        piece = adapter.slice(hop.start, hop.end).detach() if adapter is not None else None
        request = ForwardRequest(hop.start, hop.end, hidden, session_id, step, head_extra or extra, adapter=piece)
        work = request.rows * (hop.end - hop.start)
        started = time.perf_counter()
        output = self.loop.run(self.caller.forward(hop.peer_id, request, self.health.timeout(hop.peer_id, work)))
        output = self._as_output(output, head_extra, head, hop.peer_id)  # before the success is recorded
        self.health.record_success(hop.peer_id, time.perf_counter() - started, work)
        if isinstance(output, Predictions):
            output = Predictions(self.spot_checker.maybe_check(request, hop.peer_id, output.rows, head), head)
        else:
            output = self.spot_checker.maybe_check(request, hop.peer_id, output)
        if trace is not None:  # only a checked (or unchecked) answer: a disputed hop is redone, traced once
            trace.append(HopTrace(hop.peer_id, hop.start, hop.end, hidden))
        return output, hop.end
