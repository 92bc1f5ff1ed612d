"""Experts over the swarm: finding compatible servers of a domain, querying them, failing over.

A :class:`RemoteExpert` is an :class:`~swarm.diffusion.composition.ExpertSource`: ``submit`` starts the
query on the client's background loop and returns at once, so the expert computes while the backbone's
route does; ``result`` waits for it. A server that fails is banned (with the route's bans, so a dead server
is avoided by both) and the same query goes to the next server of the domain; when none is left the expert
raises :class:`ExpertUnavailable` and the composition drops it with a warning.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any, Iterable, Optional

import torch
from hivemind.dht import DHT

from swarm.client.remote import RemoteCaller, as_remote_error
from swarm.client.sequence import FailoverEvent, RemoteSequence
from swarm.diffusion.composition import (
    CompatibilityTag, ExpertNotFoundError, ExpertUnavailable, IncompatibleExpertError,
)
from swarm.diffusion.sampler import DenoiseContext
from swarm.dht.schema import ExpertRecord, ServerState, expert_key, read_expert_records
from swarm.protocol import ErrorCode, ExpertRequest, RemoteError
from swarm.utils.event_loop import BackgroundLoop

logger = logging.getLogger(__name__)


def find_expert_servers(dht: DHT, prefix: str, domain: str, backbone: CompatibilityTag) -> list[ExpertRecord]:
    """Online, compatible servers of ``domain``, fastest first.

    Raises :class:`ExpertNotFoundError` when none is online and :class:`IncompatibleExpertError` when every
    online one announces a different tokenizer, vocabulary or mask token.
    """
    records = [r for r in read_expert_records(dht, prefix, domain).values() if r.state == ServerState.ONLINE]
    if not records:
        raise ExpertNotFoundError(f"no online server hosts expert {domain!r} (DHT key {expert_key(prefix, domain)})")
    compatible = [r for r in records if not backbone.mismatches(r.tag)]
    if not compatible:
        problems = sorted({"; ".join(backbone.mismatches(r.tag)) for r in records})
        raise IncompatibleExpertError(f"expert {domain!r} is incompatible with the backbone on every server that "
                                      f"hosts it ({len(records)}): {' | '.join(problems)}")
    return sorted(compatible, key=lambda r: (-r.throughput, r.peer_id))


class PendingRemote:
    """One submitted query; ``result`` fails over to the domain's other servers."""

    def __init__(self, expert: "RemoteExpert", request: ExpertRequest):
        self.expert = expert
        self.request = request
        self.peer_id = expert.current()
        self.future = expert.start(self.peer_id, request) if self.peer_id else None

    def result(self) -> torch.Tensor:
        errors: list[str] = []
        while self.peer_id is not None:
            try:
                return self.future.result(self.expert.timeout + 5.0)
            except (RemoteError, concurrent.futures.TimeoutError) as error:
                self.future.cancel()
                error = as_remote_error(error, self.peer_id)
                errors.append(f"{self.peer_id[-8:]}: {error.message}")
                self.expert.failed(self.peer_id, error)
            self.peer_id = self.expert.current()
            self.future = self.expert.start(self.peer_id, self.request) if self.peer_id else None
        raise ExpertUnavailable(f"no server of expert {self.expert.domain!r} is left "
                                f"({'; '.join(errors) or 'all were avoided after failures'})")


class RemoteExpert:
    """One expert domain served by the swarm (see the module's docstring)."""

    def __init__(self, domain: str, servers: Iterable[ExpertRecord], caller: RemoteCaller, loop: BackgroundLoop,
                 sequence: RemoteSequence, timeout: float):
        self.domain = domain
        self.servers = list(servers)
        self.caller, self.loop, self.sequence = caller, loop, sequence
        self.timeout = timeout
        self.failed_peers: set[str] = set()
        self.failovers: list[FailoverEvent] = []
        self.used: list[str] = []

    def current(self) -> Optional[str]:
        """The preferred server not failed in this generation nor excluded by the route (banned, distrusted,
        off the allow-list), if any."""
        excluded = self.sequence.excluded() | self.failed_peers
        allowed = self.sequence.allowed
        for record in self.servers:
            if record.peer_id not in excluded and (allowed is None or record.peer_id in allowed):
                return record.peer_id
        return None

    def start(self, peer_id: str, request: ExpertRequest) -> concurrent.futures.Future:
        if peer_id not in self.used:
            self.used.append(peer_id)
        coroutine = self.caller.expert_logits(peer_id, request, self.timeout)
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop.loop)

    def failed(self, peer_id: str, error: RemoteError) -> None:
        self.failed_peers.add(peer_id)
        self.failovers.append(FailoverEvent(peer_id, -1, f"expert {self.domain}: {error}"))
        self.sequence.ban(peer_id, f"expert {self.domain!r}: {error}", busy=error.code == ErrorCode.BUSY)

    def submit(self, tokens: torch.Tensor, context: DenoiseContext) -> PendingRemote:
        request = ExpertRequest(self.domain, tokens, context.block_start, context.block_end, step=context.steps[0])
        return PendingRemote(self, request)

    def describe(self) -> dict[str, Any]:
        return {"servers": [r.peer_id for r in self.servers], "used": list(self.used),
                "failovers": [vars(event) for event in self.failovers]}


def open_remote_experts(
    names: Iterable[str], *, dht: DHT, prefix: str, backbone: CompatibilityTag, caller: RemoteCaller,
    loop: BackgroundLoop, sequence: RemoteSequence, timeout: float, required: bool,
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
        sources[name] = RemoteExpert(name, servers, caller, loop, sequence, timeout)
    logger.info("experts %s over %s (%.2f s to find)", ", ".join(sources) or "none", prefix, time.monotonic() - started)
    return sources, warnings
