"""A server's life: load a span and/or experts, join the DHT, serve, announce, and leave cleanly."""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Callable, Optional, Sequence

import torch
from hivemind.dht import DHT

from swarm.adapters.kinds import PER_BLOCK_KINDS
from swarm.adapters.sharing import AdapterLibrary, declare_hosted
from swarm.dht.compatibility import CompatibilityTag
from swarm.dht.identity import Identity
from swarm.dht.node import check_listen_addresses, start_dht, stop_dht
from swarm.dht.schema import (
    MAX_ADDRESSES,
    ExpertRecord,
    ServerRecord,
    ServerState,
    declare_experts,
    declare_span,
    default_prefix,
    now,
    protected_keys,
    read_servers,
)
from swarm.governance.guard import GovernanceGuard
from swarm.governance.keys import trusted_signers
from swarm.models import invariance
from swarm.models.checkpoint import parse_dtype
from swarm.models.invariance import DeviceInvariance, check_module
from swarm.models.loading import EXACT, ModelFiles, numerics, resolve_device
from swarm.models.modules import OutputHead
from swarm.models.quantization import quantize_span_int8
from swarm.server.adapter_tensors import AdapterTensors
from swarm.server.backend import SpanBackend, StreamLimits
from swarm.server.block_selection import choose_span
from swarm.server.config import ServerConfig
from swarm.server.expert_handler import ExpertHandler
from swarm.server.experts import (
    ExpertBackend,
    HostedExpert,
    default_dtype,
    load_expert,
    measure_expert_throughput,
    parse_expert_spec,
)
from swarm.server.handler import ForwardHandler
from swarm.server.push import PushLimits
from swarm.server.scheduler import FairScheduler
from swarm.server.session_cache import SessionCaches
from swarm.server.throughput import measure_throughput
from swarm.server.usage import UsageLedger
from swarm.version import __version__
from swarm.weights.holdings import hosts_policies
from swarm.weights.service import ServeLimits, WeightServer
from swarm.weights.source import SwarmWeights
from swarm.weights.trust import PublisherTrust
from swarm.wire.receipts import ReceiptSigner

logger = logging.getLogger(__name__)


def listening_addresses(maddrs: Sequence) -> list[str]:
    """Multiaddrs to announce, without their ``/p2p/<peer id>`` part (the record says whose they are)."""
    return [str(addr).rsplit("/p2p/", 1)[0] for addr in maddrs][:MAX_ADDRESSES]  # a relayed one keeps the relay's


class Server:
    """Hosts blocks ``start:end`` of a model and/or whole expert models, served over hivemind's P2P layer.

    ``experts`` are ``--expert`` values (``NAME_OR_PATH`` or ``DOMAIN=NAME_OR_PATH``). With experts and
    neither ``blocks`` nor ``num_blocks`` in the config, the server hosts only the experts.
    """

    def __init__(self, config: ServerConfig, experts: Sequence[str] = ()):
        self.config = config
        check_listen_addresses(config.network.host_maddrs)  # a port in use is refused before anything loads
        resolve_device(config.device)  # before loading anything: "cuda" without CUDA fails here, clearly
        trust = PublisherTrust.of(config.trusted_publishers, config.governance_keys)  # whose names --model follows
        self.files = ModelFiles(config.model, resolvers=[SwarmWeights(config.network, trust=trust).resolve])
        self.weights = WeightServer(ServeLimits(mbps=config.serve_weights_mbps)) if config.serve_weights else None
        self.model_config = self.files.config
        self._check_span_settings()
        self.prefix = config.dht_prefix or default_prefix(self.files.path)
        if config.compute_threads:
            torch.set_num_threads(config.compute_threads)
        self.experts = self._load_experts(experts)  # before joining: an incompatible expert fails fast
        self.adapters = AdapterLibrary(config.serve_adapters)  # before joining, too: a bad directory fails fast
        self.hosts_blocks = not self.experts or config.blocks is not None or config.num_blocks is not None
        # The libp2p identity signs the records too, so they prove the peer id they speak for.
        self.identity = Identity.load_or_create(config.network.identity_path)
        # Storage here keeps only what readers use under the model's keys (swarm.dht.schema.protected_keys).
        protect = protected_keys(self.prefix, self.model_config.num_layers, trusted_signers(config.governance_keys))
        protect += hosts_policies(self.files.path)
        self.dht: DHT = start_dht(config.network, identity=self.identity, protect=protect)
        self.peer_id = str(self.dht.peer_id)
        self.subkey = self.identity.owner_subkey()
        self.governance = GovernanceGuard(self.dht, self.prefix, config.governance_keys, ttl=0.0,
                                          stale_after=config.governance_stale_after)
        self.start: Optional[int] = None
        self.end: Optional[int] = None
        self.numerics = EXACT  # what differs from the checkpoint's numerics, announced in the record
        self.invariance = DeviceInvariance(False, "no blocks loaded")  # whether batching changes no row, announced
        if not config.batch_invariant:
            invariance.turn_off()
        self.addresses: list[str] = []  # where this server listens, announced once it serves
        self.usage = UsageLedger(config.max_share_per_caller, config.share_window)  # per caller: its compute here
        self.backend = self._load_span() if self.hosts_blocks else None
        self.expert_backend = ExpertBackend(self.experts, config.max_concurrent_requests, config.device,
                                            config.max_queued_tokens, config.peer_share) if self.experts else None
        expert_handler = ExpertHandler(
            self.expert_backend, max_batch_tokens=config.max_batch_tokens, wire_dtype=config.wire_dtype,
            request_timeout=config.request_timeout,
        ) if self.expert_backend else None
        push_limits = PushLimits(config.max_pending_pushes, int(config.push_memory_mb * 2**20), config.push_timeout,
                                 config.peer_share)
        self.handler = ForwardHandler(
            self.backend, hidden_size=self.model_config.hidden_size, max_batch_tokens=config.max_batch_tokens,
            wire_dtype=config.wire_dtype, request_timeout=config.request_timeout, info=self.info,
            experts=expert_handler, caches=self._session_caches(), num_layers=self.model_config.num_layers,
            push_limits=push_limits, allow_backward=config.allow_backward,
            adapter_tensors=AdapterTensors(int(config.adapter_memory_mb * 2**20), config.peer_share),
            usage=self.usage, receipts=ReceiptSigner(self.identity.private_key, self.prefix,
                                                     exact=self.numerics == EXACT, invariant=self.invariance.exact),
        )
        self.handler.adapters = self.adapters
        self.state = ServerState.JOINING
        self._stop: Optional[asyncio.Event] = None

    def _load_span(self) -> SpanBackend:
        self.start, self.end = self._pick_blocks()
        logger.info("loading blocks %d:%d of %s from %s", self.start, self.end, self.prefix, self.files.path)
        if self.config.quant not in (None, "int8"):  # before reading any weights
            raise ValueError(f"unknown quantization {self.config.quant!r}; choose int8")
        dtype = parse_dtype(default_dtype(self.files, self.config.dtype))
        self.numerics = numerics(self.files.default_dtype, dtype, self.config.quant)
        if self.numerics != EXACT:
            logger.warning("approximate server (%s): clients use it only when they allow approximate servers",
                           self.numerics)
        span = self.files.span(self.start, self.end, dtype)
        if self.config.quant == "int8":
            span = quantize_span_int8(span)
        self.span = span.to(self.config.device)
        self.throughput = self._throughput(lambda: measure_throughput(self.span, self.config.device))
        head = self._load_head(dtype)
        self.invariance = check_module(torch.nn.ModuleList([self.span, *([head] if head is not None else [])]))
        logger.info("batch-invariant passes: %s (%s)", "yes" if self.invariance.exact else "no", self.invariance.why)
        batching = self.config.batching and self.invariance.exact
        if self.config.batching and not batching:  # merged rows could change a client's tokens at a near-tie
            logger.warning("not batching clients' requests together: %s", self.invariance.why)
        return SpanBackend(self.span, self.config.max_concurrent_requests, self.config.device,
                           max_queued_tokens=self.config.max_queued_tokens, peer_share=self.config.peer_share,
                           head=head, streams=StreamLimits.of(self.config), scheduler=self._scheduler(),
                           batching=batching, max_batch_tokens=self.config.max_batch_tokens,
                           max_piece_tokens=self.config.max_piece_tokens)

    def _scheduler(self) -> FairScheduler:
        """Fair by caller where callers prove work (their standing halves every --share-window seconds); over its
        share, served last."""
        usage = self.usage
        return FairScheduler(half_life=self.config.share_window,
                             over_share=lambda peer: usage.over_share(peer, time.time()))

    def _load_head(self, dtype: torch.dtype) -> Optional[OutputHead]:
        """The final norm and output head (``--head``), in the span's dtype: only with the last block."""
        if not self.config.head:
            return None
        if self.end != self.model_config.num_layers:
            raise ValueError(f"--head needs the span to end at the last block ({self.model_config.num_layers}), "
                             f"not at {self.end}")
        logger.info("loading the output head: this server answers head queries")
        return self.files.head(dtype).to(self.config.device).eval()

    def _session_caches(self) -> Optional[SessionCaches]:
        if self.backend is None:
            return None
        dtype = torch.float32 if self.config.quant == "int8" else self.backend.dtype  # int8 spans compute in float32
        return SessionCaches(self.model_config, int(self.config.cache_memory_mb * 2**20), self.config.cache_ttl,
                             fill_timeout=self.config.request_timeout, max_entries=self.config.cache_max_entries,
                             dtype=dtype, device=self.config.device)

    def _load_experts(self, texts: Sequence[str]) -> dict[str, HostedExpert]:
        """Load each expert and refuse one that cannot be composed with this swarm's backbone."""
        specs = [parse_expert_spec(text) for text in texts]
        domains = [spec.domain for spec in specs]
        duplicates = sorted({d for d in domains if domains.count(d) > 1})
        if duplicates:
            raise ValueError(f"--expert: each domain may be hosted once per server, got {', '.join(duplicates)} twice")
        if not specs:
            return {}
        backbone = CompatibilityTag.of(self.model_config, self.files.tokenizer())
        experts = {}
        for spec in specs:
            expert = load_expert(spec, self.config.device, self.config.dtype)
            backbone.require_compatible(expert.tag, spec.domain)
            expert.throughput = self._throughput(lambda: measure_expert_throughput(expert, self.config.device))
            experts[spec.domain] = expert
        return experts

    def _check_span_settings(self) -> None:
        """Refuse a span the model cannot have before joining the swarm (``--num-blocks 0`` once served 0:16)."""
        blocks, num_blocks, num_layers = self.config.blocks, self.config.num_blocks, self.model_config.num_layers
        if blocks is not None and num_blocks is not None:
            raise ValueError("give --blocks (the span) or --num-blocks (its length, placed automatically), not both")
        if blocks is not None and not 0 <= blocks[0] < blocks[1] <= num_layers:
            raise ValueError(f"--blocks {blocks[0]}:{blocks[1]} is not inside the model's {num_layers} blocks")
        if num_blocks is not None and not 1 <= num_blocks <= num_layers:
            raise ValueError(f"--num-blocks {num_blocks} must be 1..{num_layers}, the model's number of blocks")

    def _pick_blocks(self) -> tuple[int, int]:
        num_layers = self.model_config.num_layers
        if self.config.blocks is not None:  # checked by _check_span_settings
            return self.config.blocks
        servers = read_servers(self.dht, self.prefix, num_layers).values()
        return choose_span(servers, num_layers, self.config.num_blocks or num_layers)

    def _throughput(self, measure: Callable[[], float]) -> float:
        if self.config.throughput == "auto":
            return measure()
        try:
            return float(self.config.throughput)
        except ValueError:
            raise ValueError(f"--throughput must be 'auto' or a number, got {self.config.throughput!r}") from None

    def record(self) -> ServerRecord:
        return ServerRecord(
            peer_id=self.peer_id, state=self.state, start=self.start, end=self.end, throughput=self.throughput,
            public_name=self.config.public_name, version=__version__, cache_tokens_left=self.cache_tokens_left(),
            experts=sorted(self.experts),
            numerics=self.numerics, addresses=self.addresses, head=self.backend is not None and
            self.backend.head is not None, adapter_kinds=list(PER_BLOCK_KINDS),
            batch_invariant=self.invariance.exact,
        )

    def cache_tokens_left(self) -> int:
        """The activation cache's free room in tokens of one sequence through this server's span (0 without one)."""
        caches = self.handler.caches
        return caches.tokens_left(self.end - self.start) if caches is not None else 0

    def expert_records(self) -> list[ExpertRecord]:
        return [ExpertRecord(peer_id=self.peer_id, domain=domain, state=self.state, tag=expert.tag,
                             throughput=expert.throughput, model=expert.label, public_name=self.config.public_name,
                             version=__version__)
                for domain, expert in sorted(self.experts.items())]

    def info(self) -> dict:
        return {"peer_id": self.peer_id, "prefix": self.prefix, "start": self.start, "end": self.end,
                "experts": sorted(self.experts),
                "state": int(self.state), "version": __version__, "hidden_size": self.model_config.hidden_size,
                "num_layers": self.model_config.num_layers, "wire_dtype": self.config.wire_dtype,
                "numerics": self.numerics, "batch_invariance": self.invariance.to_json(),
                "batching": self.backend is not None and self.backend.queue.merge is not None,
                "requests_served": self.handler.requests_served, "requests_failed": self.handler.requests_failed,
                "rows_computed": self.handler.rows_computed, "compute_seconds": self.handler.compute_seconds,
                "cache": self.handler.caches.info() if self.handler.caches else None,
                "admission": {name: backend.queue.info() for name, backend in
                              (("span", self.backend), ("experts", self.expert_backend)) if backend is not None},
                "push": self.handler.pusher.info(), "adapter_tensors": self.handler.adapter_tensors.info(),
                "usage": self.handler.usage.info(time.time()), "work_stamps": self.handler.stamps.info()}

    def announce(self, timeout: float = 30.0) -> bool:
        """Store the current records (blocks, experts); False if the DHT did not confirm within ``timeout``."""
        expiration = now() + self.config.record_expiration
        futures = []
        if self.hosts_blocks:
            futures.append(declare_span(self.dht, self.prefix, self.record(), self.subkey, expiration, wait=False))
        if self.experts:
            futures.append(declare_experts(self.dht, self.prefix, self.expert_records(), self.subkey, expiration,
                                           wait=False))
        if self.adapters.files and self.state != ServerState.OFFLINE:  # leaving: the hosts records expire
            futures.append(declare_hosted(self.dht, self.prefix, self.adapters.sizes, self.subkey, expiration,
                                          self.addresses, wait=False))
        if self.weights is not None and self.state != ServerState.OFFLINE:
            futures += filter(None, [self.weights.declare(self.dht, self.peer_id, self.subkey, expiration,
                                                          self.addresses)])
        deadline = time.monotonic() + timeout
        try:
            return all([bool(f.result(max(0.0, deadline - time.monotonic()))) for f in futures])
        except Exception as error:  # a timeout or a dead DHT process: report, never hang
            logger.warning("announcement failed: %r", error)
            return False

    def describe(self) -> str:
        """What this server hosts, for logs: ``blocks 0:4 and experts code, addition``."""
        parts = [f"blocks {self.start}:{self.end}"] if self.hosts_blocks else []
        parts += [f"experts {', '.join(sorted(self.experts))}"] if self.experts else []
        return " and ".join(parts)

    def in_flight(self) -> int:
        return sum(b.in_flight for b in (self.backend, self.expert_backend) if b is not None)

    # ----- running -------------------------------------------------------------------------------
    async def serve(self, on_ready: Optional[Callable[["Server"], None]] = None) -> None:
        """Serve until SIGINT/SIGTERM, then leave the swarm cleanly; ``on_ready`` runs once serving."""
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        p2p = await self.dht.replicate_p2p()
        self.addresses = listening_addresses(await p2p.get_visible_maddrs())
        await self.handler.add_p2p_handlers(p2p)
        self.handler.pusher.attach(p2p, self.model_config if self.backend is not None else None)
        if self.weights is not None:  # announced as soon as known (a directory's manifest hashes every byte)
            await self.weights.add_p2p_handlers(p2p)
            self.weights.start(self.files.path, on_ready=lambda: loop.run_in_executor(None, self.announce))
        self.state = ServerState.ONLINE
        await loop.run_in_executor(None, self.announce)
        logger.info("serving %s of %s as %s", self.describe(), self.prefix, self.peer_id)
        if on_ready is not None:
            on_ready(self)
        watcher = asyncio.create_task(self._watch_governance()) if self.governance.enabled else None
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self.config.update_period)
            except asyncio.TimeoutError:  # relays gained or lost since the last announcement reach the record
                self.addresses = listening_addresses(await p2p.get_visible_maddrs(latest=True))
                await loop.run_in_executor(None, self.announce)  # the store blocks: keep the loop serving
        if watcher is not None:
            watcher.cancel()
        await self._leave(p2p)

    async def _watch_governance(self) -> None:
        """Refuse new steps while a valid signed halt stands, or while the governance state cannot be read for
        longer than ``--governance-stale-after`` (fail safe); serve again after a newer resume."""
        loop = asyncio.get_running_loop()
        while True:
            decision = await loop.run_in_executor(None, self.governance.current)
            reason = (decision.reason or "no reason given") if decision is not None and decision.halted else None
            reason = reason or self.governance.unreadable()
            if reason != self.handler.halt_reason:
                logger.warning("governance: %s", f"halted ({reason})" if reason else "resumed")
                self.handler.halt_reason = reason
            await asyncio.sleep(self.config.governance_poll)

    async def _leave(self, p2p) -> None:
        logger.info("shutting down: announcing offline")
        self.handler.accepting = False
        self.state = ServerState.OFFLINE
        deadline = time.monotonic() + self.config.request_timeout
        while self.in_flight() and time.monotonic() < deadline:  # let running requests finish
            await asyncio.sleep(0.05)
        if self.dht.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self.announce, 5.0)
        await self.handler.pusher.close()
        try:
            await asyncio.wait_for(self.handler.remove_p2p_handlers(p2p), 5.0)
            if self.weights is not None:
                await asyncio.wait_for(self.weights.remove_p2p_handlers(p2p), 5.0)
        except Exception as error:  # the daemon may already be gone; shutdown continues regardless
            logger.warning("could not remove RPC handlers: %r", error)
        for backend in (self.backend, self.expert_backend):
            if backend is not None:
                backend.shutdown()
        stop_dht(self.dht)
        logger.info("server stopped")
