"""Calling one server: the forward RPC (unary or streamed, by size), expert queries and the info/ping RPC.

Part of the wire layer: clients call servers with it, and servers call the next server of a pushed route.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import AsyncIterator, Awaitable, Callable, Optional

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.asyncio import iter_as_aiter
from multiaddr import Multiaddr

from swarm.diffusion.prediction import answer_shape
from swarm.protocol import (
    AUTO_WIRE,
    ErrorCode,
    ExpertQuery,
    ForwardRequest,
    RemoteError,
    SpanService,
    collect_ack,
    collect_response,
    expert_query_message,
    request_parts,
)

logger = logging.getLogger(__name__)


class RemoteCaller:
    """Thin async wrapper over a server's RPCs; every failure surfaces as :class:`RemoteError`."""

    def __init__(self, p2p: P2P, wire_dtype: str = AUTO_WIRE, latency: float = 0.0, jitter: float = 0.0):
        """``latency``/``jitter`` emulate a wide-area network in user space (benchmarks only): each crossing,
        request or answer, is delayed by ``latency`` plus up to ``jitter`` seconds, so a call costs two."""
        self.p2p = p2p
        self.wire_dtype = wire_dtype
        self.latency, self.jitter = latency, jitter
        self.calls = 0
        self.rows_sent = 0  # batch x length of hidden states sent in forward requests
        self.bytes_sent = self.bytes_received = 0  # serialized forward requests and answers (benchmarks read them)

    async def crossing(self) -> None:
        """One emulated one-way network crossing (nothing unless latency is injected)."""
        if self.latency or self.jitter:
            await asyncio.sleep(self.latency + random.uniform(0, self.jitter))

    def _stub(self, peer_id: str):
        return SpanService.get_stub(self.p2p, PeerID.from_base58(peer_id))

    async def connect(self, peer_id: str, addresses: list[str], timeout: float) -> None:
        """Dial ``peer_id`` at ``addresses`` (from its signed record): the daemon may only know an old address of
        a server that restarted elsewhere. hivemind's P2P has no public call for this; its client has."""
        try:
            maddrs = [Multiaddr(address) for address in addresses]
            await asyncio.wait_for(self.p2p._client.connect(PeerID.from_base58(peer_id), maddrs), timeout)
        except Exception as error:
            raise as_remote_error(error, peer_id) from error

    async def info(self, peer_id: str, timeout: float) -> tuple[dict, float]:
        """The server's self-description and the round-trip time of asking for it."""
        started = time.perf_counter()
        try:
            reply = await self._stub(peer_id).rpc_info(runtime_pb2.ExpertUID(uid="info"), timeout=timeout)
        except Exception as error:
            raise as_remote_error(error, peer_id) from error
        return MSGPackSerializer.loads(reply.serialized_info), time.perf_counter() - started

    async def _call(self, peer_id: str, rpc: Callable[[], Awaitable[list]], timeout: float,
                    collect: Callable[..., tuple] = collect_response) -> tuple:
        """One RPC to one server: counted, delayed both ways when latency is injected, bounded by ``timeout``,
        and every failure turned into a :class:`RemoteError`. An answer whose stream lost parts on the way is
        asked for once more before it counts as the server's failure."""
        retries = 1
        while True:
            self.calls += 1
            await self.crossing()
            try:
                responses = await asyncio.wait_for(rpc(), timeout)
            except Exception as error:
                raise as_remote_error(error, peer_id) from error
            await self.crossing()
            try:
                return collect(responses, peer_id)
            except RemoteError as error:
                if error.code != ErrorCode.INCOMPLETE or retries == 0:
                    raise
                retries -= 1
                logger.warning("answer from %s was incomplete (%s): asking again", peer_id, error.message)

    def _forward_rpc(self, peer_id: str, request: ForwardRequest) -> Callable[[], Awaitable[list]]:
        parts = request_parts(request, self.wire_dtype)
        stub = self._stub(peer_id)
        self.rows_sent += request.rows
        self.bytes_sent += sum(part.ByteSize() for part in parts)

        async def rpc() -> list:
            if len(parts) == 1:
                responses = [await stub.rpc_forward(parts[0])]
            else:
                responses = await _read_stream(stub.rpc_forward_stream(iter_as_aiter(parts)))
            self.bytes_received += sum(response.ByteSize() for response in responses)
            return responses

        return rpc

    async def push(self, peer_id: str, request: ForwardRequest, timeout: float) -> None:
        """Send a request whose ``extra["push"]`` names the next hops; the server only acknowledges it."""
        await self._call(peer_id, self._forward_rpc(peer_id, request), timeout, collect_ack)

    async def forward(self, peer_id: str, request: ForwardRequest, timeout: float) -> torch.Tensor:
        """Hidden states after the server's blocks ``request.start:request.end`` (with a head query in
        ``request.extra``, the head server's predictions: :mod:`swarm.diffusion.prediction`)."""
        output, _ = await self._call(peer_id, self._forward_rpc(peer_id, request), timeout)
        expected = answer_shape(request.extra["head"]) if "head" in request.extra else tuple(request.hidden.shape)
        if tuple(output.shape) != expected:
            raise RemoteError(ErrorCode.INTERNAL, f"server returned shape {tuple(output.shape)}, "
                              f"expected {expected}", peer_id)
        return output

    async def expert_logits(self, peer_id: str, request: ExpertQuery, timeout: float) -> torch.Tensor:
        """Log-probabilities (batch, end - start, vocab) from the server's hosted expert ``request.domain``."""
        stub = self._stub(peer_id)

        async def rpc() -> list:
            return [response async for response in await stub.rpc_expert_logits(expert_query_message(request))]

        log_probs, _ = await self._call(peer_id, rpc, timeout)
        batch = request.tokens.shape[0]
        if log_probs.dim() != 3 or tuple(log_probs.shape[:2]) != (batch, request.end - request.start):
            raise RemoteError(ErrorCode.INTERNAL, f"expert returned shape {tuple(log_probs.shape)}, expected "
                              f"({batch}, {request.end - request.start}, vocab)", peer_id)
        return log_probs


async def _read_stream(call: Awaitable[AsyncIterator]) -> list:
    """Every answer of a stream RPC. A server that refuses a request early (too large, busy) answers and
    closes while the rest is still being sent: the answer it gave is kept instead of the broken pipe."""
    responses: list = []
    try:
        async for response in await call:
            responses.append(response)
    except (BrokenPipeError, ConnectionResetError):
        if not responses:
            raise
    return responses


def as_remote_error(error: BaseException, peer_id: Optional[str]) -> RemoteError:
    """Connection errors, timeouts and daemon errors all become one error type the client can route around."""
    if isinstance(error, RemoteError):
        return error
    if isinstance(error, asyncio.TimeoutError):
        return RemoteError(ErrorCode.TIMEOUT, "no answer within the timeout", peer_id)
    return RemoteError(ErrorCode.UNREACHABLE, f"{type(error).__name__}: {error}", peer_id)
