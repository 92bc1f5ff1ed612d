"""A server's life: load a span, join the DHT, serve, announce, and leave cleanly."""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Callable, Optional

import torch
from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator

import swarm
from swarm.dht.node import start_dht, stop_dht
from swarm.dht.schema import (
    ServerRecord, ServerState, declare_span, default_prefix, now, owner_subkey, read_servers,
)
from swarm.models.loading import ModelFiles
from swarm.models.quantization import quantize_span_int8
from swarm.server.backend import SpanBackend
from swarm.server.block_selection import choose_span
from swarm.server.config import ServerConfig
from swarm.server.handler import ForwardHandler
from swarm.server.throughput import measure_throughput

logger = logging.getLogger(__name__)


class Server:
    """Hosts blocks ``start:end`` of a model and serves forward passes over hivemind's P2P layer."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.files = ModelFiles(config.model)
        self.model_config = self.files.config
        self.prefix = config.dht_prefix or default_prefix(self.files.path)
        if config.compute_threads:
            torch.set_num_threads(config.compute_threads)
        self.validator = RSASignatureValidator()
        self.dht: DHT = start_dht(config.network, [self.validator])
        self.peer_id = str(self.dht.peer_id)
        self.subkey = owner_subkey(self.peer_id, self.validator)
        self.start, self.end = self._pick_blocks()
        logger.info("loading blocks %d:%d of %s from %s", self.start, self.end, self.prefix, self.files.path)
        dtype = config.dtype or ("float32" if self.files.format.name == "native" else "bfloat16")
        span = self.files.span(self.start, self.end, dtype)
        if config.quant == "int8":
            span = quantize_span_int8(span)
        elif config.quant is not None:
            raise ValueError(f"unknown quantization {config.quant!r}; choose int8")
        self.span = span.to(config.device)
        self.throughput = self._throughput()
        self.backend = SpanBackend(self.span, config.max_concurrent_requests, config.device)
        self.handler = ForwardHandler(
            self.backend, hidden_size=self.model_config.hidden_size, max_batch_tokens=config.max_batch_tokens,
            wire_dtype=config.wire_dtype, request_timeout=config.request_timeout, info=self.info,
        )
        self.state = ServerState.JOINING
        self._stop: Optional[asyncio.Event] = None

    def _pick_blocks(self) -> tuple[int, int]:
        num_layers = self.model_config.num_layers
        if self.config.blocks is not None:
            start, end = self.config.blocks
            if not 0 <= start < end <= num_layers:
                raise ValueError(f"--blocks {start}:{end} is not inside the model's {num_layers} blocks")
            return start, end
        servers = read_servers(self.dht, self.prefix, num_layers).values()
        return choose_span(servers, num_layers, self.config.num_blocks or num_layers)

    def _throughput(self) -> float:
        if self.config.throughput == "auto":
            return measure_throughput(self.span, self.config.device)
        try:
            return float(self.config.throughput)
        except ValueError:
            raise ValueError(f"--throughput must be 'auto' or a number, got {self.config.throughput!r}") from None

    def record(self) -> ServerRecord:
        return ServerRecord(
            peer_id=self.peer_id, state=self.state, start=self.start, end=self.end, throughput=self.throughput,
            public_name=self.config.public_name, version=swarm.__version__,
        )

    def info(self) -> dict:
        return {"peer_id": self.peer_id, "prefix": self.prefix, "start": self.start, "end": self.end,
                "state": int(self.state), "version": swarm.__version__, "hidden_size": self.model_config.hidden_size,
                "num_layers": self.model_config.num_layers, "wire_dtype": self.config.wire_dtype,
                "requests_served": self.handler.requests_served, "requests_failed": self.handler.requests_failed}

    def announce(self, timeout: float = 30.0) -> bool:
        """Store the current record on every block key; False if the DHT did not confirm within ``timeout``."""
        future = declare_span(self.dht, self.prefix, self.record(), self.subkey,
                              now() + self.config.record_expiration, wait=False)
        try:
            return bool(future.result(timeout))
        except Exception as error:  # a timeout or a dead DHT process: report, never hang
            logger.warning("announcement failed: %r", error)
            return False

    # ----- running -------------------------------------------------------------------------------
    async def serve(self, on_ready: Optional[Callable[["Server"], None]] = None) -> None:
        """Serve until SIGINT/SIGTERM, then leave the swarm cleanly; ``on_ready`` runs once serving."""
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        p2p = await self.dht.replicate_p2p()
        await self.handler.add_p2p_handlers(p2p)
        self.state = ServerState.ONLINE
        await loop.run_in_executor(None, self.announce)
        logger.info("serving blocks %d:%d of %s as %s", self.start, self.end, self.prefix, self.peer_id)
        if on_ready is not None:
            on_ready(self)
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self.config.update_period)
            except asyncio.TimeoutError:
                await loop.run_in_executor(None, self.announce)  # the store blocks: keep the loop serving
        await self._leave(p2p)

    async def _leave(self, p2p) -> None:
        logger.info("shutting down: announcing offline")
        self.handler.accepting = False
        self.state = ServerState.OFFLINE
        deadline = time.monotonic() + self.config.request_timeout
        while self.backend.in_flight and time.monotonic() < deadline:  # let running requests finish
            await asyncio.sleep(0.05)
        if self.dht.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self.announce, 5.0)
        try:
            await asyncio.wait_for(self.handler.remove_p2p_handlers(p2p), 5.0)
        except Exception as error:  # the daemon may already be gone; shutdown continues regardless
            logger.warning("could not remove RPC handlers: %r", error)
        self.backend.shutdown()
        stop_dht(self.dht)
        logger.info("server stopped")
