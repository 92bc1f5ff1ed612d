"""Experts over the swarm: finding compatible servers of a domain, querying them, failing over.

A :class:`RemoteExpert` is an :class:`~swarm.diffusion.experts.ExpertSource`: ``submit`` starts the
query on the client's background loop and returns at once, so the expert computes while the backbone's
route does; ``result`` waits for it. A server that fails is recorded in the client's :class:`PeerHealth`
(so a dead server is avoided by the route too) and the same query goes to the next server of the domain,
through the same failover loop as span calls; when none is left the expert raises
:class:`ExpertUnavailable` and the composition drops it with a warning.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any, Iterable, Optional, Union

import torch
from hivemind.dht import DHT

from swarm.client.config import ClientConfig
from swarm.client.failover import FailoverEvent, RetriesExhausted, RetryBudget, call_with_failover
from swarm.client.peers import PeerHealth
from swarm.dht.compatibility import CompatibilityTag, IncompatibleExpertError
from swarm.dht.schema import ExpertRecord, ServerState, expert_index_key, read_expert_records
from swarm.diffusion.denoiser import DenoiseContext, Pending
from swarm.diffusion.experts import ExpertNotFoundError, ExpertUnavailable
from swarm.diffusion.sparse import SparseScores
from swarm.utils.event_loop import BackgroundLoop
from swarm.wire.messages import ErrorCode, ExpertQuery, RemoteError
from swarm.wire.remote import RemoteCaller

logger = logging.getLogger(__name__)


def find_expert_servers(dht: DHT, prefix: str, domain: str, backbone: CompatibilityTag) -> list[ExpertRecord]:
    """Online, compatible servers of ``domain``, fastest first.

    Raises :class:`ExpertNotFoundError` when none is online and :class:`IncompatibleExpertError` when every
    online one announces a different tokenizer, vocabulary or mask token.
    """
    records = [r for r in read_expert_records(dht, prefix, domain).values() if r.state == ServerState.ONLINE]
    if not records:
        raise ExpertNotFoundError(f"no online server hosts expert {domain!r} (DHT key {expert_index_key(prefix)})")
    compatible = [r for r in records if not backbone.mismatches(r.tag)]
    if not compatible:
        problems = sorted({"; ".join(backbone.mismatches(r.tag)) for r in records})
        raise IncompatibleExpertError(f"expert {domain!r} is incompatible with the backbone on every server that "
                                      f"hosts it ({len(records)}): {' | '.join(problems)}")
    return sorted(compatible, key=lambda r: (-r.throughput, r.peer_id))


class PendingRemote(Pending):
    """One submitted query; ``result`` fails over to the domain's other servers (the shared failover loop)."""

    def __init__(self, expert: "RemoteExpert", request: ExpertQuery):
        self.expert = expert
        self.request = request
        self.first_peer = expert.pick(frozenset())
        self.first = expert.start(self.first_peer, request) if self.first_peer else None

    def result(self) -> Union[torch.Tensor, SparseScores]:
        expert = self.expert
        budget = RetryBudget(expert.config)
        try:
            return call_with_failover(
                self._pick, lambda peer: peer, self._attempt, health=expert.health, budget=budget,
                final=lambda error: None, on_failure=lambda peer, error: expert.failed(peer, error),
                label=lambda peer: f"expert {expert.domain}",
            )
        except ExpertUnavailable as error:
            raise ExpertUnavailable(f"{error} ({'; '.join(budget.errors) or 'all were avoided after failures'})")
        except RetriesExhausted as error:
            raise ExpertUnavailable(f"expert {expert.domain!r}: {error}") from None

    def cancel(self) -> None:
        """Not needed any more: drop the query started at submit time (one still running on a server finishes)."""
        if self.first is not None:
            self.first.cancel()

    def _pick(self, avoid: frozenset[str]) -> str:
        peer = self.expert.pick(avoid)
        if peer is None:
            raise ExpertUnavailable(f"no server of expert {self.expert.domain!r} is left")
        return peer

    def _attempt(self, peer: str) -> Union[torch.Tensor, SparseScores]:
        """The answer of ``peer``: the query started at submit time when it went there, else a new one."""
        future = self.first if peer == self.first_peer and self.first is not None else None
        self.first = None  # a pre-started query is waited for once
        future = future or self.expert.start(peer, self.request)
        try:
            return future.result(self.expert.config.request_timeout + 5.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise RemoteError(ErrorCode.TIMEOUT, "no answer within the timeout", peer) from None


class RemoteExpert:
    """One expert domain served by the swarm (see the module's docstring)."""

    def __init__(self, domain: str, servers: Iterable[ExpertRecord], caller: RemoteCaller, loop: BackgroundLoop,
                 health: PeerHealth, config: ClientConfig, vocab_size: int):
        self.domain = domain
        self.vocab_size = vocab_size  # the backbone's: an answer over another vocabulary is the server's failure
        self.servers = list(servers)
        self.caller, self.loop, self.health, self.config = caller, loop, health, config
        self.failed_peers: set[str] = set()
        self.failovers: list[FailoverEvent] = []
        self.used: list[str] = []

    def pick(self, avoid: frozenset[str]) -> Optional[str]:
        """The preferred server not failed in this generation, not in ``avoid`` and usable per the client's
        peer health (not banned, distrusted or off the allow-list), if any."""
        peers = [record.peer_id for record in self.servers]
        excluded = self.health.excluded(peers) | self.failed_peers | avoid
        return next((peer for peer in peers if peer not in excluded), None)

    def start(self, peer_id: str, request: ExpertQuery) -> concurrent.futures.Future:
        """Send the query now (it runs on the background loop); its time refines the peer's measured speed."""
        if peer_id not in self.used:
            self.used.append(peer_id)
        work = request.tokens.numel()

        async def query() -> Union[torch.Tensor, SparseScores]:
            started = time.perf_counter()
            log_probs = await self.caller.expert_logits(peer_id, request, self.health.timeout(peer_id, work, "expert"),
                                                        self.vocab_size)
            self.health.record_success(peer_id, time.perf_counter() - started, work, "expert")
            return log_probs

        return asyncio.run_coroutine_threadsafe(query(), self.loop.loop)

    def failed(self, peer_id: str, error: RemoteError) -> None:
        """A failed query: the peer is not asked again for this domain in this generation (the health's ban,
        recorded by the failover loop, keeps the route away from it too)."""
        self.failed_peers.add(peer_id)
        self.failovers.append(FailoverEvent(peer_id, -1, f"expert {self.domain}: {error}"))

    def submit(self, tokens: torch.Tensor, context: DenoiseContext, top_k: int = 0) -> PendingRemote:
        request = ExpertQuery(self.domain, tokens, context.block_start, context.last_block_end,
                              step=context.steps[0], top_k=top_k)
        return PendingRemote(self, request)

    def to_dict(self) -> dict[str, Any]:
        return {"servers": [r.peer_id for r in self.servers], "used": list(self.used),
                "failovers": [vars(event) for event in self.failovers]}


def open_remote_experts(
    names: Iterable[str], *, dht: DHT, prefix: str, backbone: CompatibilityTag, caller: RemoteCaller,
    loop: BackgroundLoop, health: PeerHealth, config: ClientConfig, required: bool,
) -> tuple[dict[str, RemoteExpert], list[str]]:
    """Sources for the named domains; with ``required`` false (``experts="auto"``) a missing or incompatible
    domain is skipped with a warning instead of raising."""
    started = time.monotonic()
    sources, warnings = {}, []
    for name in names:
        try:
            servers = find_expert_servers(dht, prefix, name, backbone)
        except (ExpertNotFoundError, IncompatibleExpertError) as error:
            if required:
                raise
            warnings.append(f"{error} (skipped)")
            continue
        sources[name] = RemoteExpert(name, servers, caller, loop, health, config, backbone.vocab_size)
    logger.info("experts %s over %s (%.2f s to find)", ", ".join(sources) or "none", prefix, time.monotonic() - started)
    return sources, warnings
