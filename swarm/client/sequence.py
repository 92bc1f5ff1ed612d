"""Running hidden states through every block of the model over the swarm, with failover.

Keeps the list of servers read from the DHT, their measured round trips, the peers banned for failing,
and the current route. When a server fails mid-step the step continues from the failed block over other
servers: the result is the same, because a call depends on no earlier call, except through the activation
cache, whose absence on a new server is reported as a cache miss and repaired by a fill.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import torch
from hivemind.dht import DHT

from swarm.client.config import ClientConfig
from swarm.client.push import PushReceiver
from swarm.client.remote import RemoteCaller
from swarm.client.routing import MissingBlocksError, RouteHop, find_route
from swarm.client.spot_check import SpotChecker
from swarm.diffusion.sampler import Halted
from swarm.dht.schema import ServerRecord, ServerState, read_servers
from swarm.models.kv_cache import CacheMiss
from swarm.protocol import ErrorCode, ForwardRequest, RemoteError
from swarm.utils.event_loop import BackgroundLoop

logger = logging.getLogger(__name__)

# Errors that say the request itself is wrong: retrying elsewhere cannot help.
CLIENT_FAULTS = {ErrorCode.BAD_REQUEST, ErrorCode.TOO_LARGE, ErrorCode.NOT_FINITE, ErrorCode.HALTED}


@dataclass
class Ban:
    until: float
    count: int
    busy: bool  # a full server: avoided briefly, and worth waiting for when nothing else covers its blocks


class SwarmError(RuntimeError):
    """A denoiser call gave up after the configured retries or time."""


@dataclass
class FailoverEvent:
    peer_id: str
    block: int
    error: str
    at: float = field(default_factory=time.time)


class RemoteSequence:
    def __init__(self, dht: DHT, caller: RemoteCaller, loop: BackgroundLoop, prefix: str, num_blocks: int,
                 config: ClientConfig):
        self.dht, self.caller, self.loop = dht, caller, loop
        self.prefix, self.num_blocks, self.config = prefix, num_blocks, config
        self.servers: dict[str, ServerRecord] = {}
        self.latencies: dict[str, float] = {}
        self.bans: dict[str, Ban] = {}
        self.route: list[RouteHop] = []
        self.failovers: list[FailoverEvent] = []
        self.distrusted: set[str] = set()  # caught returning wrong results: never used again by this client
        self.allowed: Optional[frozenset[str]] = None  # when set, only these peers may serve (restricted tier)
        self.spot_checker = SpotChecker(self, config.spot_check_rtol, config.spot_check_seed)
        self.spot_checker.fraction = config.spot_check_fraction
        self._refreshed_at = 0.0
        self._route_lock = threading.RLock()  # calls in flight (stale pipelining) share the route
        self.receiver: Optional[PushReceiver] = None  # set when push is enabled

    # ----- servers and route ----------------------------------------------------------------------
    def banned(self) -> frozenset[str]:
        now = time.monotonic()
        return frozenset(peer for peer, ban in self.bans.items() if ban.until > now)

    def excluded(self) -> frozenset[str]:
        """Peers a route may not use now: banned for failing, caught lying, or not on the allow-list."""
        out = set(self.banned()) | self.distrusted
        if self.allowed is not None:
            out |= {peer for peer in self.servers if peer not in self.allowed}
        return frozenset(out)

    def ban(self, peer_id: str, reason: str, busy: bool = False) -> None:
        """Avoid a peer: briefly when it is busy, otherwise for a period that doubles on each repeat."""
        previous = self.bans.get(peer_id)
        count = previous.count + 1 if previous else 1
        if busy:
            duration = min(self.config.backoff_base * 2 ** (count - 1), self.config.backoff_max)
        else:
            duration = min(self.config.ban_base * 2 ** (count - 1), self.config.ban_max)
        self.bans[peer_id] = Ban(time.monotonic() + duration, count, busy)
        logger.warning("avoiding peer %s for %.1f s: %s", peer_id, duration, reason)

    def wait_for_busy(self) -> Optional[float]:
        """Seconds until the first busy peer may be tried again, or None when no busy peer is waiting."""
        now = time.monotonic()
        waits = [ban.until - now for ban in self.bans.values() if ban.busy and ban.until > now]
        return min(waits) if waits else None

    def refresh(self) -> None:
        """Re-read servers from the DHT and ping those not measured yet."""
        self.servers = read_servers(self.dht, self.prefix, self.num_blocks)
        online = [p for p, r in self.servers.items() if r.state == ServerState.ONLINE and p not in self.latencies]
        if online:
            results = self.loop.run(self._ping_all(online))
            for peer_id, outcome in zip(online, results):
                if isinstance(outcome, BaseException):
                    self.ban(peer_id, f"unreachable: {outcome}")
                else:
                    self.latencies[peer_id] = outcome
        self._refreshed_at = time.monotonic()
        logger.info("%d servers known for %s (%d online)", len(self.servers), self.prefix,
                    sum(r.state == ServerState.ONLINE for r in self.servers.values()))

    async def _ping_all(self, peers: list[str]) -> list:
        async def ping(peer_id: str) -> float:
            info, rtt = await self.caller.info(peer_id, self.config.connect_timeout)
            if info.get("prefix") != self.prefix:
                raise RemoteError(ErrorCode.WRONG_SPAN, f"serves {info.get('prefix')!r}, not {self.prefix!r}", peer_id)
            return rtt

        return await asyncio.gather(*(ping(p) for p in peers), return_exceptions=True)

    def build_route(self, start_block: int = 0, tokens: int = 128) -> list[RouteHop]:
        with self._route_lock:
            if self._servers_stale() or not self.servers:
                self.refresh()
            try:
                tail = find_route(self.servers, self.num_blocks, start_block, self.latencies, self.excluded(), tokens)
            except MissingBlocksError:
                self.refresh()  # the DHT may know servers that joined since the last read
                tail = find_route(self.servers, self.num_blocks, start_block, self.latencies, self.excluded(), tokens)
            self.route = [hop for hop in self.route if hop.end <= start_block] + tail
            logger.info("route: %s", " -> ".join(map(str, self.route)))
            return self.route

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

    def hop_from(self, block: int, tokens: int) -> RouteHop:
        excluded = self.excluded()
        for hop in self.route:
            if hop.start == block and hop.peer_id not in excluded:
                return hop
        route = self.build_route(block, tokens)
        return next(hop for hop in route if hop.start == block)

    def full_route(self, tokens: int) -> list[RouteHop]:
        """The current route when every hop is usable and it covers every block, else a rebuilt one."""
        route, excluded = list(self.route), self.excluded()
        if not route or route[-1].end != self.num_blocks or any(hop.peer_id in excluded for hop in route):
            route = list(self.build_route(0, tokens))
        return route

    # ----- one pass through all blocks -------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, session_id: Optional[str] = None, step: int = -1,
                extra: Optional[dict] = None) -> torch.Tensor:
        """Hidden states after every block, retrying failed hops elsewhere within the configured bounds.

        ``extra`` travels with every hop (the activation-cache directive). A hop without the session's cache
        raises :class:`CacheMiss`. With ``ClientConfig.push`` the pass is first tried as one pushed chain.
        """
        extra = dict(extra or {})
        tokens = hidden.shape[0] * hidden.shape[1]
        if session_id is None:  # a one-off pass; generations refresh between their sessions
            self.refresh_if_stale(tokens)
        session_id = session_id or uuid.uuid4().hex
        if self.receiver is not None and self.spot_checker.fraction == 0:
            pushed = self._try_push(hidden, session_id, step, extra, tokens)
            if pushed is not None:
                return pushed
        return self._hop_by_hop(hidden, session_id, step, extra, tokens)

    def _try_push(self, hidden: torch.Tensor, session_id: str, step: int, extra: dict,
                  tokens: int) -> Optional[torch.Tensor]:
        """One pushed pass over the whole route, or None when it failed and the hop-by-hop path should run."""
        route = self.full_route(tokens)
        try:
            output = self.loop.run(self._pushed_pass(route, hidden, session_id, step, extra))
        except RemoteError as error:
            self._raise_if_final(error, step)
            logger.warning("pushed pass failed (%s): continuing hop by hop", error)
            return None
        except asyncio.TimeoutError:
            logger.warning("pushed pass got no delivery within %.0f s: continuing hop by hop", self.config.request_timeout)
            return None
        if output.shape != hidden.shape:
            logger.warning("pushed pass returned shape %s, expected %s: continuing hop by hop",
                           tuple(output.shape), tuple(hidden.shape))
            return None
        return output

    async def _pushed_pass(self, route: list[RouteHop], hidden: torch.Tensor, session_id: str, step: int,
                           extra: dict) -> torch.Tensor:
        push_id = uuid.uuid4().hex
        delivery = self.receiver.expect(push_id)
        try:
            first = route[0]
            spec = {"route": [[hop.peer_id, hop.start, hop.end] for hop in route[1:]], "reply_to": self.receiver.peer_id,
                    "namespace": self.receiver.namespace, "id": push_id,
                    "hop_delay": [self.caller.latency, self.caller.jitter]}
            request = ForwardRequest(first.start, first.end, hidden, session_id, step, dict(extra, push=spec))
            await self.caller.push(first.peer_id, request, self.config.request_timeout)
            return await asyncio.wait_for(delivery, self.config.request_timeout)
        finally:
            self.receiver.forget(push_id)

    def _raise_if_final(self, error: RemoteError, step: int) -> None:
        """Errors no other server can fix: a missing cache, a governance halt, a bad request."""
        if error.code == ErrorCode.CACHE_MISS:
            raise CacheMiss(error.message)
        if error.code == ErrorCode.HALTED:  # a server obeys a governance halt this client has not seen
            raise Halted(step, error.message, {"peer": error.peer_id})
        if error.code in CLIENT_FAULTS:
            raise error

    def _hop_by_hop(self, hidden: torch.Tensor, session_id: str, step: int, extra: dict, tokens: int) -> torch.Tensor:
        block, attempts, started = 0, 0, time.monotonic()
        delay = self.config.backoff_base
        errors: list[str] = []
        while block < self.num_blocks:
            try:
                hop = self.hop_from(block, tokens)
                request = ForwardRequest(block, hop.end, hidden, session_id, step, extra)
                output = self.loop.run(self.caller.forward(hop.peer_id, request, self.config.request_timeout))
                if "cache" not in extra or extra["cache"]["rows"] is None:  # a replica holds no reuse cache
                    output = self.spot_checker.maybe_check(request, hop.peer_id, output)
                hidden = output
                block = hop.end
                continue
            except MissingBlocksError as error:
                pause = self.wait_for_busy()
                if pause is None:  # nobody to wait for: say which blocks and what was tried
                    raise MissingBlocksError(error.blocks, list(errors) or None) from None
                errors.append(str(error))
            except RemoteError as error:
                error.peer_id = error.peer_id or hop.peer_id
                self._raise_if_final(error, step)
                errors.append(f"{hop.peer_id[-8:]}@{block}: {error.message}")
                self.failovers.append(FailoverEvent(hop.peer_id, block, str(error)))
                self.ban(hop.peer_id, str(error), busy=error.code == ErrorCode.BUSY)
                pause = delay
                delay = min(2 * delay, self.config.backoff_max)
            attempts += 1
            elapsed = time.monotonic() - started
            if attempts > self.config.max_retries or elapsed + pause > self.config.retry_deadline:
                raise SwarmError(f"gave up at block {block} after {attempts} failed attempts in {elapsed:.1f} s: "
                                 f"{'; '.join(errors)}")
            time.sleep(pause)
        return hidden
