"""The expert RPC's checks and answer: every field is checked before any compute, errors are RemoteError.

Wired into the server's :class:`~swarm.server.handler.ForwardHandler` (one servicer per server), which
adds the shared shutdown check, error accounting and conversion of unexpected failures.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from hivemind.proto import runtime_pb2

from swarm.diffusion.config import MAX_EXPERT_TOP_K
from swarm.diffusion.experts import expert_scores
from swarm.diffusion.sparse import SparseScores
from swarm.server.experts import ExpertBackend, HostedExpert
from swarm.server.validation import MAX_SESSION_ID_LENGTH, require
from swarm.wire.encoding import decode_tensor, parse_metadata, response_parts
from swarm.wire.messages import ErrorCode

logger = logging.getLogger(__name__)

TOKEN_DTYPES = ("int64", "int32")
MAX_RESPONSE_SCORES = 2**24  # batch x positions x vocabulary of one answer: 64 MiB in float32
PAYLOAD_SLACK_BYTES = 64 * 1024


class ExpertHandler:
    def __init__(self, backend: ExpertBackend, *, max_batch_tokens: int, wire_dtype: str, request_timeout: float,
                 max_response_scores: int = MAX_RESPONSE_SCORES, max_top_k: int = MAX_EXPERT_TOP_K):
        self.backend = backend
        self.max_batch_tokens = max_batch_tokens
        self.max_payload_bytes = max_batch_tokens * 8 + PAYLOAD_SLACK_BYTES
        self.wire_dtype = wire_dtype
        self.request_timeout = request_timeout
        self.max_response_scores = max_response_scores
        self.max_top_k = max_top_k

    @property
    def domains(self) -> list[str]:
        return sorted(self.backend.experts)

    async def serve(self, request: runtime_pb2.ExpertRequest, peer: str = "") -> list[runtime_pb2.ExpertResponse]:
        """The log-probabilities asked for; ``peer`` (the caller's id) is counted in the backend's admission."""
        require(request.ByteSize() <= self.max_payload_bytes, ErrorCode.TOO_LARGE,
                f"payload over {self.max_payload_bytes} bytes")
        metadata = parse_metadata(request.metadata)
        expert = self._expert(metadata.get("domain"))
        require(len(request.tensors) == 1, ErrorCode.BAD_REQUEST,
                f"expected one tensor of token ids, got {len(request.tensors)}")
        proto = request.tensors[0]
        batch, length = self._declared_shape(proto, expert)
        start, end = validate_expert_metadata(metadata, length)
        top_k = validate_top_k(metadata, self.max_top_k)
        scores = min(top_k, expert.config.vocab_size) if top_k else expert.config.vocab_size
        require(batch * (end - start) * scores <= self.max_response_scores, ErrorCode.TOO_LARGE,
                f"{batch} rows x {end - start} positions x {scores} tokens exceeds this server's "
                f"answer limit of {self.max_response_scores} scores")
        tokens = decode_tensor(proto)
        require(tuple(tokens.shape) == (batch, length), ErrorCode.BAD_REQUEST,
                f"decoded shape {tuple(tokens.shape)} differs from the declared {(batch, length)}")
        require(bool(((tokens >= 0) & (tokens < expert.config.vocab_size)).all()), ErrorCode.BAD_REQUEST,
                f"token ids must be in [0, {expert.config.vocab_size})")
        log_probs = await asyncio.wait_for(self.backend.log_probs(expert, tokens, start, end, peer),
                                           self.request_timeout)
        answer = expert_scores(log_probs, top_k)
        if isinstance(answer, SparseScores):  # the scores in float32 (a client checks that each row sums to 1)
            scores, ids = answer.wire_tensors()
            return response_parts(scores, "float32", {"top_k": answer.k}, second=ids)
        return response_parts(answer, self.wire_dtype)

    def _expert(self, domain: Any) -> HostedExpert:
        require(isinstance(domain, str), ErrorCode.BAD_REQUEST, f"metadata 'domain' must be a string, got {domain!r}")
        expert = self.backend.experts.get(domain)
        require(expert is not None, ErrorCode.NO_EXPERT,
                f"this server hosts no expert {domain!r} (it hosts: {', '.join(self.domains) or 'none'})")
        return expert

    def _declared_shape(self, proto: runtime_pb2.Tensor, expert: HostedExpert) -> tuple[int, int]:
        """Shape and dtype as declared, checked before decoding (a forged shape never allocates)."""
        require(proto.dtype in TOKEN_DTYPES, ErrorCode.BAD_REQUEST,
                f"token ids must be int64 or int32, got {proto.dtype!r}")
        require(len(proto.size) == 2, ErrorCode.BAD_REQUEST,
                f"token ids must have shape (batch, length), got {tuple(proto.size)}")
        batch, length = proto.size
        require(batch > 0 and length > 0, ErrorCode.BAD_REQUEST, f"empty batch {(batch, length)}")
        require(batch * length <= self.max_batch_tokens, ErrorCode.TOO_LARGE,
                f"{batch} x {length} = {batch * length} tokens exceeds this server's limit of {self.max_batch_tokens}")
        require(length <= expert.config.max_position_embeddings, ErrorCode.TOO_LARGE,
                f"length {length} exceeds the expert's context of {expert.config.max_position_embeddings} positions")
        return batch, length


def validate_expert_metadata(metadata: dict[str, Any], length: int) -> tuple[int, int]:
    """Positions ``start:end`` inside the sequence; session id and step of the right types."""
    start, end = metadata.get("start"), metadata.get("end")
    require(isinstance(start, int) and isinstance(end, int), ErrorCode.BAD_REQUEST,
            f"metadata 'start' and 'end' must be integers, got {start!r} and {end!r}")
    require(0 <= start < end <= length, ErrorCode.BAD_REQUEST,
            f"positions {start}:{end} requested of a sequence of {length} tokens")
    session_id = metadata.get("session_id", "")
    require(isinstance(session_id, str) and len(session_id) <= MAX_SESSION_ID_LENGTH, ErrorCode.BAD_REQUEST,
            f"session_id must be a string of at most {MAX_SESSION_ID_LENGTH} characters")
    require(isinstance(metadata.get("step", -1), int), ErrorCode.BAD_REQUEST, "step must be an integer")
    return start, end


def validate_top_k(metadata: dict[str, Any], max_top_k: int) -> int:
    """The tokens per position asked for (0: all of them), within this server's bound."""
    top_k = metadata.get("top_k", 0)
    require(isinstance(top_k, int) and not isinstance(top_k, bool) and 0 <= top_k <= max_top_k, ErrorCode.BAD_REQUEST,
            f"metadata 'top_k' must be an integer in [0, {max_top_k}] (0: every token), got {top_k!r}")
    return top_k
