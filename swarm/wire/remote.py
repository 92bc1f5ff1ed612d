"""Calling one server: the forward and backward RPCs (unary or streamed, by size), expert queries and the info/ping
RPC.

Part of the wire layer: clients call servers with it, and servers call the next server of a pushed route.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Optional, Sequence, TypeVar, Union

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.asyncio import iter_as_aiter
from multiaddr import Multiaddr

from swarm.diffusion.sparse import SparseScores
from swarm.wire.encoding import (
    AUTO_WIRE,
    WIRE_ANSWER,
    adapter_declared,
    adapter_request,
    collect_ack,
    collect_response,
    encode_tensor,
    expert_query_message,
    request_parts,
    response_metadata,
)
from swarm.wire.messages import BackwardRequest, ErrorCode, ExpertQuery, ForwardRequest, RemoteError
from swarm.wire.receipts import CallContent, Receipt, tensor_digest
from swarm.wire.services import SpanService
from swarm.wire.work import Stamper, announced_floor

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_HELD_ADAPTERS = 4096  # (server, digest) pairs remembered; an old one forgotten costs one upload
# A server whose "I keep it" (prompt_held) turns out false this often, and more often than true, is not believed
# again: each false claim costs the client a wasted call and a resend, and a liar could claim forever.
MAX_BROKEN_HOLDS = 3
HASH_OFF_LOOP_BYTES = 2**20  # adapter tensors larger than this are hashed in a thread (~1 GB/s)


WIRE_HIDDEN = "_wire_hidden"  # keys no server sends: what a call sent, kept beside its answer's metadata
ADAPTER_DIGEST = "_adapter_digest"


@dataclass(frozen=True)
class SignedCall:
    """A forward call as it travelled, with the receipt its server signed (None from a server that signs none)."""

    peer_id: str
    request: ForwardRequest
    receipt: Optional[Receipt]
    hidden: runtime_pb2.Tensor
    answer: runtime_pb2.Tensor


@dataclass
class HoldScore:
    """A server's record on its "I keep it" (``prompt_held``): named calls it served, and named calls that found
    the tensor gone."""

    served: int = 0
    missed: int = 0

    @property
    def broken(self) -> bool:
        """Broken often, and more often than kept: not to be believed again."""
        return self.missed >= MAX_BROKEN_HOLDS and self.missed > self.served


class RemoteCaller:
    """Thin async wrapper over a server's RPCs; every failure surfaces as :class:`RemoteError`."""

    def __init__(self, p2p: P2P, wire_dtype: str = AUTO_WIRE, latency: float = 0.0, jitter: float = 0.0,
                 adapter_by_digest: bool = True, stamper: Optional[Stamper] = None):
        """``latency``/``jitter`` emulate a wide-area network in user space (benchmarks only): each crossing,
        request or answer, is delayed by ``latency`` plus up to ``jitter`` seconds, so a call costs two. With
        ``adapter_by_digest`` an adapter's tensor goes to each server once while the server keeps it. With a
        ``stamper`` every forward request carries proof of work for its server's fair order (swarm.wire.work)."""
        self.p2p = p2p
        self.stamper = stamper
        self.adapter_by_digest = adapter_by_digest
        self.adapters_held: OrderedDict[tuple[str, str], None] = OrderedDict()  # (peer, digest) the peer said it keeps
        self.adapter_misses = 0  # calls that named a tensor the server no longer held, and sent it again
        self.named_calls: dict[str, HoldScore] = {}  # how each peer kept its "I keep it"
        self.holds_distrusted: set[str] = set()  # peers whose prompt_held is no longer believed
        self.wire_dtype = wire_dtype
        self.latency, self.jitter = latency, jitter
        self.calls = 0
        self.rows_sent = 0  # batch x length of hidden states sent in forward requests
        self.bytes_sent = self.bytes_received = 0  # serialized forward requests and answers (benchmarks read them)
        self.expert_bytes_received = 0  # serialized expert answers
        # Called with every forward answer and its checked receipt (None: receipts are neither checked nor kept)
        self.on_receipt: Optional[Callable[[SignedCall], None]] = None

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

    async def dialing(self, peer_id: str, addresses: Sequence[str], timeout: float,
                      call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, and when the daemon cannot reach ``peer_id`` (it may know only an address the server no longer
        listens on) a dial of ``addresses`` (from the peer's signed record) within ``timeout`` and ``call()`` again."""
        try:
            return await call()
        except RemoteError as error:
            if error.code != ErrorCode.UNREACHABLE or not addresses:
                raise
        await self.connect(peer_id, list(addresses), timeout)
        return await call()

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

    def _forward_rpc(self, peer_id: str, request: ForwardRequest, backward: bool = False
                     ) -> Callable[[], Awaitable[list]]:
        """The forward RPC, or with ``backward`` the backward RPC (whose request has a forward's form, always sent
        in its own dtype: float32 gradients are not rounded on the wire)."""
        uid = "backward" if backward else "forward"
        wire_dtype = AUTO_WIRE if backward else self.wire_dtype
        hidden = encode_tensor(request.hidden, wire_dtype)
        parts = request_parts(request, wire_dtype, uid, hidden=hidden)
        stub = self._stub(peer_id)
        self.rows_sent += request.rows
        self.bytes_sent += sum(part.ByteSize() for part in parts)
        unary, stream = ((stub.rpc_backward, stub.rpc_backward_stream) if backward
                         else (stub.rpc_forward, stub.rpc_forward_stream))

        async def rpc() -> list:
            if len(parts) == 1:
                responses = [await unary(parts[0])]
            else:
                responses = await read_stream(stream(iter_as_aiter(parts)))
            self.bytes_received += sum(response.ByteSize() for response in responses)
            return responses

        rpc.hidden = hidden  # what a receipt's call digest covers
        return rpc

    async def _signed_call(self, peer_id: str, request: ForwardRequest, timeout: float, backward: bool
                           ) -> tuple[torch.Tensor, dict]:
        """One call; a forward answer's metadata also holds the request's hidden states as they travelled (what its
        receipt signs; backward calls carry no receipt)."""
        rpc = self._forward_rpc(peer_id, request, backward)
        output, metadata = await self._call(peer_id, rpc, timeout)
        if not backward:
            metadata[WIRE_HIDDEN] = rpc.hidden
        return output, metadata

    async def _adapted_call(self, peer_id: str, request: ForwardRequest, timeout: float, backward: bool = False
                            ) -> tuple[torch.Tensor, dict]:
        """A forward or backward call whose adapter tensor, if it has one, is named by digest when ``peer_id``
        said it keeps it, and sent otherwise (or when the server no longer has it: ``adapter_miss``)."""
        digest = None
        if request.adapter is not None and self.adapter_by_digest and peer_id not in self.holds_distrusted:
            digest = await self._digest(request)
            if (peer_id, digest) in self.adapters_held:
                self.adapters_held.move_to_end((peer_id, digest))
                named = dataclasses.replace(request, adapter_digest=digest)
                try:
                    answer = await self._signed_call(peer_id, named, timeout, backward)
                    self._count_named(peer_id, missed=False)
                    answer[1][ADAPTER_DIGEST] = digest
                    return answer
                except RemoteError as error:
                    if error.code != ErrorCode.ADAPTER_MISS:
                        raise
                    del self.adapters_held[peer_id, digest]
                    self.adapter_misses += 1
                    self._count_named(peer_id, missed=True)
                    logger.debug("%s no longer holds adapter tensor %s: sending it", peer_id, digest[:16])
        output, metadata = await self._signed_call(peer_id, request, timeout, backward)
        if digest is not None and metadata.get("prompt_held") is True and peer_id not in self.holds_distrusted:
            self.adapters_held[peer_id, digest] = None
            while len(self.adapters_held) > MAX_HELD_ADAPTERS:
                self.adapters_held.popitem(last=False)
        metadata[ADAPTER_DIGEST] = digest
        return output, metadata

    def _count_named(self, peer_id: str, missed: bool) -> None:
        """Keep score of a server's "I keep it": one that breaks it often, and more often than it keeps it, gets
        the tensor with every call from now on (what a server that keeps none costs), never a named call."""
        score = self.named_calls.setdefault(peer_id, HoldScore())
        if not missed:
            score.served += 1
            return
        score.missed += 1
        if score.broken and peer_id not in self.holds_distrusted:
            self.holds_distrusted.add(peer_id)
            for key in [key for key in self.adapters_held if key[0] == peer_id]:
                del self.adapters_held[key]
            logger.warning("%s said it kept adapter tensors and then did not have them %d times (%d named calls "
                           "served): sending it the tensor with every call from now on", peer_id, score.missed,
                           score.served)

    @staticmethod
    async def _digest(request: ForwardRequest) -> str:
        if request.adapter.weights.numel() * 4 <= HASH_OFF_LOOP_BYTES:
            return request.adapter.digest()
        return await asyncio.to_thread(request.adapter.digest)

    async def _stamped(self, peer_id: str, request: ForwardRequest) -> ForwardRequest:
        return await self.stamper.stamp(peer_id, request) if self.stamper is not None else request

    def _note_contention(self, peer_id: str, metadata: dict) -> None:
        if self.stamper is not None:
            self.stamper.note(peer_id, metadata.get("contended") is True, floor=announced_floor(metadata))

    async def push(self, peer_id: str, request: ForwardRequest, timeout: float) -> None:
        """Send a request whose ``push`` names the next hops; the server only acknowledges it."""
        request = await self._stamped(peer_id, request)
        _, metadata = await self._call(peer_id, self._forward_rpc(peer_id, request), timeout, collect_ack)
        self._note_contention(peer_id, metadata)

    async def forward(self, peer_id: str, request: ForwardRequest, timeout: float) -> torch.Tensor:
        """Hidden states after the server's blocks ``request.start:request.end`` (with a head query in
        ``request.head``, the head server's predictions: :mod:`swarm.diffusion.prediction`)."""
        output, metadata = await self._adapted_call(peer_id, await self._stamped(peer_id, request), timeout)
        self._note_contention(peer_id, metadata)
        expected = request.head.output_shape if request.head is not None else tuple(request.hidden.shape)
        if tuple(output.shape) != expected:
            raise RemoteError(ErrorCode.INTERNAL, f"server returned shape {tuple(output.shape)}, "
                              f"expected {expected}", peer_id)
        if self.on_receipt is not None and request.push is None:
            receipt = await self._checked_receipt(peer_id, request, metadata)
            self.on_receipt(SignedCall(peer_id, request, receipt, metadata[WIRE_HIDDEN], metadata[WIRE_ANSWER]))
        return output

    async def _checked_receipt(self, peer_id: str, request: ForwardRequest, metadata: dict) -> Optional[Receipt]:
        """The answer's receipt, checked against the call sent and the answer received (None when the server sent
        none: an older server); a receipt that does not hold is the server's failure."""
        raw = metadata.get("receipt")
        if raw is None:
            return None
        adapter_digest = metadata.get(ADAPTER_DIGEST)
        if request.adapter is not None and adapter_digest is None:
            adapter_digest = await self._digest(request)
        content = CallContent(request.start, request.end, request.session_id, request.step,
                              request.cache.to_dict() if request.cache is not None else None,
                              request.head.to_dict() if request.head is not None else None,
                              request.adapter.kind if request.adapter is not None else None, adapter_digest,
                              tensor_digest(metadata[WIRE_HIDDEN]))
        try:
            receipt = Receipt.from_wire(raw)
        except ValueError as error:
            raise RemoteError(ErrorCode.INTERNAL, f"malformed receipt: {error}", peer_id) from None
        problem = ("signed by another peer's key" if receipt.peer_id != peer_id
                   else "for another call" if receipt.request != content.digest()
                   else "for another answer" if receipt.answer != tensor_digest(metadata[WIRE_ANSWER])
                   else "with a signature that does not hold" if not receipt.valid_signature() else None)
        if problem is not None:
            raise RemoteError(ErrorCode.INTERNAL, f"the answer's receipt is {problem}", peer_id)
        return receipt

    async def backward(self, peer_id: str, request: BackwardRequest, timeout: float) -> torch.Tensor:
        """The gradient of the input of the server's blocks ``request.start:request.end`` (float32, the inputs'
        shape), given their inputs and the gradient of their outputs; the server's weights stay frozen."""
        return (await self.backward_all(peer_id, request, timeout))[0]

    async def backward_all(self, peer_id: str, request: BackwardRequest, timeout: float
                           ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """:meth:`backward`, and the gradient of the request's deep prompt vectors when it carries them (None
        otherwise); both checked for shape and finite values."""
        output, metadata = await self._adapted_call(peer_id, request.as_forward(), timeout, backward=True)
        grad_prompts = metadata.get("prompts")
        expected = [(output, tuple(request.inputs.shape), "gradient")]
        if request.adapter is not None:
            if grad_prompts is None:
                raise RemoteError(ErrorCode.INTERNAL, "server answered no gradient for the deep prompt", peer_id)
            expected.append((grad_prompts, tuple(request.adapter.weights.shape), "deep prompt gradient"))
        elif grad_prompts is not None:
            raise RemoteError(ErrorCode.INTERNAL, "server answered a deep prompt gradient it was not asked for",
                              peer_id)
        for tensor, shape, what in expected:
            if tuple(tensor.shape) != shape:
                raise RemoteError(ErrorCode.INTERNAL, f"server returned a {what} of shape {tuple(tensor.shape)}, "
                                  f"expected {shape}", peer_id)
            if not bool(torch.isfinite(tensor).all()):
                raise RemoteError(ErrorCode.INTERNAL, f"server returned a {what} with NaN or infinite values", peer_id)
        return output.float(), grad_prompts.float() if grad_prompts is not None else None

    async def expert_logits(self, peer_id: str, request: ExpertQuery, timeout: float, vocab_size: int
                            ) -> Union[torch.Tensor, SparseScores]:
        """Log-probabilities (batch, end - start, vocab) from the server's hosted expert ``request.domain``, or with
        ``request.top_k`` its checked sparse answer; an answer of another shape or form is the server's failure."""
        stub = self._stub(peer_id)

        async def rpc() -> list:
            responses = [response async for response in await stub.rpc_expert_logits(expert_query_message(request))]
            self.expert_bytes_received += sum(response.ByteSize() for response in responses)
            return responses

        log_probs, metadata = await self._call(peer_id, rpc, timeout)
        rows = (request.tokens.shape[0], request.end - request.start)
        if request.top_k:
            return self._sparse_answer(peer_id, log_probs, metadata.get("prompts"), rows, request.top_k, vocab_size)
        if log_probs.dim() != 3 or tuple(log_probs.shape) != (*rows, vocab_size):
            raise RemoteError(ErrorCode.INTERNAL, f"expert returned shape {tuple(log_probs.shape)}, expected "
                              f"{(*rows, vocab_size)}", peer_id)
        return log_probs

    @staticmethod
    def _sparse_answer(peer_id: str, scores: torch.Tensor, ids: Optional[torch.Tensor], rows: tuple[int, int],
                       top_k: int, vocab_size: int) -> SparseScores:
        try:
            if ids is None:
                raise ValueError("no token ids came with the scores")
            answer = SparseScores.from_wire(scores, ids, vocab_size)
            answer.check(rows, top_k)
        except ValueError as error:
            raise RemoteError(ErrorCode.INTERNAL, f"expert's sparse answer refused: {error}", peer_id) from None
        return answer

    async def adapter_files(self, peer_id: str, sha256: str, max_bytes: int, timeout: float) -> dict[str, bytes]:
        """The files of the adapter ``sha256`` served by ``peer_id``; reading stops, refused, as soon as the answer
        passes ``max_bytes`` (the published size). The caller checks the content hash."""
        self.calls += 1

        async def read() -> dict[str, bytes]:
            stream = await self._stub(peer_id).rpc_adapter_files(adapter_request(sha256))
            declared: list[tuple[str, int]] = []
            data, parts, expected = bytearray(), 0, None
            async for part in stream:
                if expected is None:
                    metadata = response_metadata([part], peer_id)
                    declared = adapter_declared(metadata, max_bytes, peer_id)
                    expected = metadata.get("parts")
                parts += 1
                data += b"".join(tensor.buffer for tensor in part.tensors)
                if len(data) > max_bytes or not isinstance(expected, int) or parts > expected:
                    raise RemoteError(ErrorCode.TOO_LARGE, f"the adapter files exceed the {max_bytes} bytes or "
                                      f"the parts the server declared", peer_id)
            if expected is None or parts != expected or len(data) != sum(size for _, size in declared):
                raise RemoteError(ErrorCode.INCOMPLETE, f"the adapter files ended after {parts} parts and "
                                  f"{len(data)} bytes", peer_id)
            files, offset = {}, 0
            for name, size in declared:
                files[name], offset = bytes(data[offset:offset + size]), offset + size
            return files

        try:
            return await asyncio.wait_for(read(), timeout)
        except Exception as error:
            raise as_remote_error(error, peer_id) from error


async def read_stream(call: Awaitable[AsyncIterator]) -> list:
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
