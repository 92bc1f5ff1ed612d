"""Calling one server: the forward RPC (unary or streamed, by size) and the info/ping RPC."""
from __future__ import annotations

import asyncio
import random
import time
from typing import Optional

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.asyncio import iter_as_aiter

from swarm.protocol import ErrorCode, ForwardRequest, RemoteError, SpanService, collect_response, request_parts


class RemoteCaller:
    """Thin async wrapper over a server's RPCs; every failure surfaces as :class:`RemoteError`."""

    def __init__(self, p2p: P2P, wire_dtype: str = "float32", latency: float = 0.0, jitter: float = 0.0):
        """``latency``/``jitter`` emulate a wide-area hop in user space (benchmarks only)."""
        self.p2p = p2p
        self.wire_dtype = wire_dtype
        self.latency, self.jitter = latency, jitter
        self.calls = 0

    def _stub(self, peer_id: str):
        return SpanService.get_stub(self.p2p, PeerID.from_base58(peer_id))

    async def info(self, peer_id: str, timeout: float) -> tuple[dict, float]:
        """The server's self-description and the round-trip time of asking for it."""
        started = time.perf_counter()
        try:
            reply = await self._stub(peer_id).rpc_info(runtime_pb2.ExpertUID(uid="info"), timeout=timeout)
        except Exception as error:
            raise _as_remote_error(error, peer_id) from error
        return MSGPackSerializer.loads(reply.serialized_info), time.perf_counter() - started

    async def forward(self, peer_id: str, request: ForwardRequest, timeout: float) -> torch.Tensor:
        parts = request_parts(request, self.wire_dtype)
        stub = self._stub(peer_id)
        self.calls += 1
        if self.latency or self.jitter:
            await asyncio.sleep(self.latency + random.uniform(0, self.jitter))
        try:
            if len(parts) == 1:
                responses = [await stub.rpc_forward(parts[0], timeout=timeout)]
            else:
                responses = await asyncio.wait_for(self._stream(stub, parts), timeout)
        except RemoteError:
            raise
        except Exception as error:
            raise _as_remote_error(error, peer_id) from error
        hidden, _ = collect_response(responses, peer_id)
        if hidden.shape != request.hidden.shape:
            raise RemoteError(ErrorCode.INTERNAL, f"server returned shape {tuple(hidden.shape)}, "
                              f"expected {tuple(request.hidden.shape)}", peer_id)
        return hidden

    @staticmethod
    async def _stream(stub, parts: list) -> list:
        stream = await stub.rpc_forward_stream(iter_as_aiter(parts))
        return [response async for response in stream]


def _as_remote_error(error: BaseException, peer_id: Optional[str]) -> RemoteError:
    """Connection errors, timeouts and daemon errors all become one error type the client can route around."""
    if isinstance(error, RemoteError):
        return error
    if isinstance(error, asyncio.TimeoutError):
        return RemoteError(ErrorCode.TIMEOUT, "no answer within the timeout", peer_id)
    return RemoteError(ErrorCode.UNREACHABLE, f"{type(error).__name__}: {error}", peer_id)
