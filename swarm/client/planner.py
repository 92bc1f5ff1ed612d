"""Planning routes through the swarm's servers: which servers exist, which may be used, and the cheapest chain.

Keeps the list of servers read from the DHT (and, with trusted auditors, their latest reports: a server whose latest
trusted audit failed is avoided like a banned one) and the current route; what the client knows about each peer
(bans, round trips, speeds, distrust) lives in :class:`~swarm.client.peers.PeerHealth`. Before a server is routed
to, it must answer a compute challenge through the span it announces, shaped like a real pass (a length drawn like
real requests', embeddings of random tokens, a plausible step), so a fake server costs one short timeout and a
server cannot answer challenges and stall real calls by telling them apart by size. The challenge proves that the
server computes a real-sized pass in time; whether it computes it *right* is the spot checks' job
(:mod:`swarm.client.spot_check`). A pass with a per-block adapter is routed only over servers whose record lists its
kind. The passes themselves run in :mod:`swarm.client.sequence`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
import time
import uuid
from typing import Callable, Optional, Sequence

import torch
from hivemind.dht import DHT

from swarm.adapters.block import BlockAdapter
from swarm.adapters.kinds import described
from swarm.client.config import ClientConfig
from swarm.client.failover import RetryBudget
from swarm.client.peers import PeerHealth
from swarm.client.routing import MissingBlocksError, RouteHop, find_route
from swarm.dht.schema import ServerRecord, ServerState, read_servers
from swarm.reports.records import AuditBook
from swarm.utils.event_loop import BackgroundLoop
from swarm.utils.text import plural
from swarm.wire.messages import ErrorCode, ForwardRequest, RemoteError
from swarm.wire.remote import RemoteCaller

logger = logging.getLogger(__name__)

# Rows of a compute challenge, drawn uniformly: the lengths of real requests (a prompt and 16-128 generated
# tokens), capped by the model's positions.
CHALLENGE_ROWS = (16, 192)
# A challenge is a prompt of at most this many random tokens, then masked positions, as a generation's first call is.
# Random tokens in every row read one embedding row each from a mapped checkpoint: at LLaDA-8B's widths 192 of them
# mapped 315 MB of its pages into the client (each fault maps its neighbours too), which a bound of 16 keeps to ~26.
CHALLENGE_PROMPT_TOKENS = 16
CHALLENGE_STEPS = 64  # a challenge carries a step drawn below this, like a generation's call


def adapter_requirement(adapter: Optional[BlockAdapter]) -> str:
    """What a server must also do for a pass with a per-block ``adapter`` (for error messages)."""
    return f"applies {described(adapter.kind)} adapters" if adapter is not None else ""


class RoutePlanner:
    """The servers one client knows and the route it uses over them (see the module doc).

    What the client knows about each peer lives in ``health`` (a :class:`PeerHealth`), shared with the passes,
    the expert queries and the spot checks.
    """

    def __init__(self, dht: DHT, caller: RemoteCaller, loop: BackgroundLoop, prefix: str, num_blocks: int,
                 hidden_size: int, config: ClientConfig, vocab_size: int = 0, mask_token_id: Optional[int] = None):
        self.dht, self.caller, self.loop = dht, caller, loop
        self.prefix, self.num_blocks, self.hidden_size, self.config = prefix, num_blocks, hidden_size, config
        self.vocab_size = vocab_size  # challenges embed random token ids below it
        self.mask_token_id = mask_token_id  # and then this one (None: random ids in every row)
        self.health = PeerHealth(config)
        self.servers: dict[str, ServerRecord] = {}
        self.route: list[RouteHop] = []
        self._refreshed_at = 0.0
        self._route_lock = threading.RLock()  # calls in flight (stale pipelining) share the route
        # Real-looking challenge inputs: the client's embedding of token ids (None: Gaussian hidden states)
        self.embed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.max_positions = CHALLENGE_ROWS[1]
        self._challenge_rng = random.SystemRandom()  # a server cannot predict a challenge's size or content
        # The reports of the auditors this client trusts (None or empty: none), read with the server list
        self.audits: Optional[AuditBook] = None
        self.overclaimed: dict[str, float] = {}  # peer -> announced / calibrated, where routes use the calibration

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

    # ----- challenges -------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read servers from the DHT and ping (with a compute challenge) those not measured yet."""
        previous, self.servers = self.servers, read_servers(self.dht, self.prefix, self.num_blocks)
        if self.audits is not None and self.audits.enabled:  # before the challenges: a failed server gets none
            self.audits.refresh(self.dht)
            self.health.audit_failures(self.audits.failed())
            self._calibrate(self.audits.calibrated())
        for peer, record in self.servers.items():
            if peer in previous and record.addresses and record.addresses != previous[peer].addresses:
                self.health.forgive(peer, f"it now announces {', '.join(record.addresses)}")
        self._ping_unmeasured()
        self._refreshed_at = time.monotonic()
        logger.info("%s known for %s (%d online)", plural(len(self.servers), "server"), self.prefix,
                    sum(r.state == ServerState.ONLINE for r in self.servers.values()))

    def _calibrate(self, calibrated: dict[str, tuple[str, float]]) -> None:
        """Route a server that announces over ``overclaim_factor`` times its trusted calibrated throughput by the
        calibration (what its delivery, measured by the auditor, is worth beside its peers' announcements): a
        server that claims to be fast is no longer preferred for it, and its calls' timeouts follow its real speed."""
        overclaimed = {}
        for peer, (auditor, figure) in calibrated.items():
            record = self.servers.get(peer)
            if record is None or record.throughput <= self.config.overclaim_factor * figure:
                continue
            overclaimed[peer] = record.throughput / figure
            if peer not in self.overclaimed:
                logger.warning("peer %s announces %.0f tokens/s, %.1fx what auditor %s... measured it to deliver "
                               "(calibrated %.0f tokens/s): routing with the calibrated figure", peer,
                               record.throughput, overclaimed[peer], auditor[:12], figure)
            self.servers[peer] = dataclasses.replace(record, throughput=figure)
        self.overclaimed = overclaimed

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
        # A first contact sets up a connection, a handful of round trips: what it took tells this link's round trip,
        # which every crossing after it is given on top of the fixed allowance (a live server on a slow link is not
        # timed out and avoided for the link).
        setup = await self._dial(peer_id, record.addresses)
        timeout = self.config.connect_timeout + self.config.timeout_factor * setup
        info, rtt = await self.caller.dialing(peer_id, record.addresses, timeout,
                                              lambda: self.caller.info(peer_id, timeout))
        if info.get("prefix") != self.prefix:
            raise RemoteError(ErrorCode.WRONG_SPAN, f"serves {info.get('prefix')!r}, not {self.prefix!r}", peer_id)
        request = self.challenge_request(record.start, record.end)
        work = request.rows * (record.end - record.start)
        started = time.perf_counter()
        try:
            output = await self.caller.forward(peer_id, request, self.challenge_timeout(record, request.rows)
                                               + self.config.timeout_factor * rtt)
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

    async def _dial(self, peer_id: str, addresses: Sequence[str]) -> float:
        """Connect to ``peer_id`` at its record's addresses (nothing crosses when a connection is open), within
        ``connect_timeout``; the seconds it took, or 0 when it failed (the daemon may know another way to the peer:
        the info call after it tells)."""
        if not addresses:
            return 0.0
        started = time.perf_counter()
        try:
            await self.caller.connect(peer_id, list(addresses), self.config.connect_timeout)
        except RemoteError as error:
            logger.debug("could not connect to %s at its announced addresses: %s", peer_id, error.message)
            return 0.0
        return time.perf_counter() - started

    def challenge_request(self, start: int, end: int) -> ForwardRequest:
        """A forward call through blocks ``start:end`` that a server cannot tell from a real uncached pass: a length
        drawn like real requests', the embeddings of a random prompt then masked positions (as a generation's first
        call), a step drawn like a generation's and a fresh session (only a client's later calls could tell it
        apart, and it has none)."""
        rng = self._challenge_rng
        low, high = CHALLENGE_ROWS
        length = rng.randint(min(low, self.max_positions), min(high, self.max_positions))
        if self.embed is not None and self.vocab_size > 0:
            prompt = length if self.mask_token_id is None else rng.randint(1, min(CHALLENGE_PROMPT_TOKENS, length))
            ids = torch.tensor([[rng.randrange(self.vocab_size) for _ in range(prompt)]
                                + [self.mask_token_id] * (length - prompt)])
            with torch.no_grad():
                hidden = self.embed(ids)
        else:
            hidden = torch.randn(1, length, self.hidden_size)
        return ForwardRequest(start, end, hidden, uuid.uuid4().hex, rng.randrange(CHALLENGE_STEPS))

    def challenge_timeout(self, record: ServerRecord, rows: int) -> float:
        """How long a challenge of ``rows`` may take: ``connect_timeout``, plus what the server's announced
        throughput predicts for the rows (a slow honest server is not failed; a fake announcing a huge
        throughput gets about ``connect_timeout``), at most ``request_timeout``."""
        compute = rows / max(record.throughput, 1e-3)
        return min(self.config.request_timeout, self.config.connect_timeout + self.config.timeout_factor * compute)

    # ----- routes -----------------------------------------------------------------------------------
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

    def next_hop(self, block: int, tokens: int, avoid: frozenset[str], budget: RetryBudget,
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

    def backward_peer(self, hop: RouteHop, avoid: frozenset[str], adapter: Optional[BlockAdapter] = None) -> str:
        """The server that computed the hop's blocks forward, else the fastest usable one holding all of them."""
        if hop.peer_id not in self.excluded(avoid, adapter):
            return hop.peer_id
        holders = self.holders(hop.start, hop.end, avoid, adapter=adapter)
        if not holders:
            self.refresh()
            holders = self.holders(hop.start, hop.end, avoid, adapter=adapter)
        if not holders:
            raise MissingBlocksError(list(range(hop.start, hop.end)), requirement=adapter_requirement(adapter))
        return holders[0]
