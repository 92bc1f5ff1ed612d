"""Wire format of the forward and expert RPCs: tensors with hivemind's serializer, metadata as msgpack.

A forward request carries hidden states (batch, length, hidden) for a span ``start:end`` of a server. Small
payloads travel as one unary message; larger ones as a stream of parts whose count is announced in the
first part's metadata and checked on arrival (a stream can lose its tail silently on loopback).

A backward request carries, for a span ``start:end``, the span's input hidden states and the gradient of its
output (same shape), stacked along the batch dimension into one tensor (2 x batch, length, hidden) so that it
travels, is bounded and validated exactly as a forward request's; the answer is the gradient of the input.

Either request may carry a second tensor, a per-block adapter's weights for the span's blocks (end - start, R,
hidden; :class:`~swarm.adapters.block.BlockAdapter`), float32, declared in the metadata (``prompt_length`` R,
``prompt_parts``, and ``prompt_kind``: ``deep_prompt`` vectors added to positions 0:R, the default, ``bottleneck``
weights of rank R / 2 applied to every row, or ``lora`` matrices of every projection packed into R rows,
``swarm/adapters/lora.py``; the names predate the other kinds and stay, so that older servers still understand
them) and sent after the hidden states' parts; the answer to a backward request that carried one carries the tensor's
gradient after the inputs' (its parts counted by ``prompt_parts`` too). When everything fits one message, the
hidden states and the adapter's tensor share it (a unary call); otherwise every message of the stream carries
one tensor part. A server that kept an adapter tensor says so in its answer (``prompt_held``); later requests then
name it by :meth:`~swarm.adapters.block.BlockAdapter.digest` (``prompt_digest``) instead of carrying it
(``swarm/server/adapter_tensors.py``).

An expert request carries token ids (batch, length) int64 and asks a hosted expert model for the
log-probabilities of positions ``start:end``; it is always small, while the answer (positions x vocabulary)
may not be, so it comes back as a stream of parts counted the same way. With ``top_k`` in its metadata the answer
is sparse (``swarm.diffusion.sparse``): float32 scores (positions, k + 1) and, as the second tensor, int32 token
ids (positions, k), the answer's metadata saying ``top_k``.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import math
from typing import Any, Callable, Optional

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarm.wire.messages import ErrorCode, ExpertQuery, ForwardRequest, RemoteError

logger = logging.getLogger(__name__)


# Unary messages are capped near 2-4 MiB by the daemon; stay well below.
MAX_UNARY_BYTES = 1024 * 1024


STREAM_CHUNK_BYTES = 512 * 1024


MAX_METADATA_BYTES = 64 * 1024  # msgpack of a request or answer: a push route of 64 hops is about 5 KiB


MAX_STREAM_MESSAGE_BYTES = 2 * MAX_UNARY_BYTES  # one message of a stream: a chunk and its metadata, with room


WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


AUTO_WIRE = "auto"  # hidden states travel in the dtype they were computed in: lossless, and half the bytes for


# bfloat16 models. "float16" (from float32) halves the bytes too but is not exact; "float32" is the old default.
WIRE_CHOICES = (AUTO_WIRE, *WIRE_DTYPES)


def expert_query_message(request: ExpertQuery) -> runtime_pb2.ExpertRequest:
    """One unary message: token ids travel exactly as int64, uncompressed."""
    tensor = serialize_torch_tensor(request.tokens.detach().long(), runtime_pb2.CompressionType.NONE)
    metadata = {"domain": request.domain, "start": request.start, "end": request.end,
                "session_id": request.session_id, "step": request.step}
    if request.top_k:
        metadata["top_k"] = request.top_k
    return runtime_pb2.ExpertRequest(uid="expert", tensors=[tensor], metadata=MSGPackSerializer.dumps(metadata))


def wire_torch_dtype(wire_dtype: str, computed: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype a tensor computed in ``computed`` travels in: ``computed`` itself for ``auto`` (lossless)."""
    if wire_dtype == AUTO_WIRE:
        return computed if computed in WIRE_DTYPES.values() else torch.float32
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {wire_dtype!r}; choose one of {', '.join(WIRE_CHOICES)}")
    return WIRE_DTYPES[wire_dtype]


def encode_tensor(tensor: torch.Tensor, wire_dtype: str = AUTO_WIRE) -> runtime_pb2.Tensor:
    """Serialize in the wire dtype. bfloat16 is sent as its own 2 bytes (hivemind's default widens it to float32
    unless ``USE_LEGACY_BFLOAT16=0``; its decoder reads both)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.float64 or not tensor.is_floating_point():  # predictions and token ids: always exact
        return serialize_torch_tensor(tensor, runtime_pb2.CompressionType.NONE)
    dtype = wire_torch_dtype(wire_dtype, tensor.dtype)
    if dtype == torch.bfloat16:
        raw = tensor.to(torch.bfloat16).contiguous().view(torch.int16)
        return runtime_pb2.Tensor(compression=runtime_pb2.CompressionType.NONE, buffer=raw.numpy().tobytes(),
                                  size=tensor.shape, dtype="bfloat16", requires_grad=False)
    compression = runtime_pb2.CompressionType.FLOAT16 if dtype == torch.float16 else runtime_pb2.CompressionType.NONE
    return serialize_torch_tensor(tensor.float(), compression)


def wire_chunks(tensor: runtime_pb2.Tensor) -> list[runtime_pb2.Tensor]:
    """The tensor whole when it fits a unary message, else the parts of a stream."""
    if tensor.ByteSize() <= MAX_UNARY_BYTES:
        return [tensor]
    return list(split_for_streaming(tensor, STREAM_CHUNK_BYTES))


def packed_chunks(main: runtime_pb2.Tensor, second: Optional[runtime_pb2.Tensor] = None
                  ) -> tuple[list[list[runtime_pb2.Tensor]], dict[str, int]]:
    """The tensor parts of each message (see the module doc) and their counts for the first part's metadata:
    ``parts`` of ``main``, then ``prompt_parts`` of ``second`` when given."""
    chunks = wire_chunks(main)
    counts = {"parts": len(chunks)}
    if second is None:
        return [[chunk] for chunk in chunks], counts
    extra = wire_chunks(second)
    counts["prompt_parts"] = len(extra)
    if len(chunks) == 1 and len(extra) == 1 and main.ByteSize() + second.ByteSize() <= MAX_UNARY_BYTES:
        return [[main, second]], counts
    return [[chunk] for chunk in chunks + extra], counts


def request_parts(request: ForwardRequest, wire_dtype: str = AUTO_WIRE, uid: str = "forward",
                  hidden: Optional[runtime_pb2.Tensor] = None) -> list[runtime_pb2.ExpertRequest]:
    """One part when small, else stream parts; the first part's metadata says how many follow. ``hidden``: the
    hidden states already encoded (the caller digests them)."""
    metadata = {"start": request.start, "end": request.end, "session_id": request.session_id,
                "step": request.step, "extra": request.directives()}
    weights = None
    if request.adapter is not None:
        metadata["prompt_length"] = request.adapter.rows
        metadata["prompt_kind"] = request.adapter.kind
        if request.adapter_digest is not None:  # the server keeps the weights from an earlier call
            metadata["prompt_digest"] = request.adapter_digest
        else:  # the client's float32 parameters: never rounded on the wire
            weights = encode_tensor(request.adapter.weights.float(), "float32")
    messages, counts = packed_chunks(hidden if hidden is not None else encode_tensor(request.hidden, wire_dtype),
                                     weights)
    metadata.update(counts)
    parts = [runtime_pb2.ExpertRequest(uid=uid, tensors=messages[0], metadata=MSGPackSerializer.dumps(metadata))]
    parts += [runtime_pb2.ExpertRequest(tensors=tensors) for tensors in messages[1:]]
    return parts


def tensor_wire_bytes(shape: tuple[int, ...], wire_dtype: str = AUTO_WIRE,
                      computed: torch.dtype = torch.float32) -> int:
    """The exact ``ByteSize()`` of :func:`encode_tensor` for a tensor of ``shape`` computed in ``computed``,
    without encoding one: a server compares it with the unary limit before computing an answer that could not
    be sent."""
    template = encode_tensor(torch.zeros(1, dtype=computed), wire_dtype)
    buffer = math.prod(shape) * _wire_element_bytes(wire_dtype, computed)
    del template.size[:]
    template.size.extend(shape)
    template.buffer = b""
    return template.ByteSize() + (1 + _varint_bytes(buffer) + buffer if buffer else 0)


@functools.lru_cache(maxsize=None)
def _wire_element_bytes(wire_dtype: str, computed: torch.dtype) -> int:
    return len(encode_tensor(torch.zeros(1, dtype=computed), wire_dtype).buffer)


def _varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def parse_metadata(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_METADATA_BYTES:
        raise RemoteError(ErrorCode.TOO_LARGE,
                          f"metadata of {len(raw)} bytes is over the limit of {MAX_METADATA_BYTES}")
    try:
        metadata = MSGPackSerializer.loads(raw) if raw else {}
    except Exception as error:  # msgpack raises several unrelated types on garbage, some with no message
        detail = str(error) or (type(error).__doc__ or "").strip().split("\n")[0]
        reason = f"{type(error).__name__}: {detail}" if detail else type(error).__name__
        raise RemoteError(ErrorCode.BAD_REQUEST, f"metadata is not valid msgpack ({reason}; {len(raw)} bytes "
                          f"starting {raw[:8].hex()})") from None
    if not isinstance(metadata, dict):
        raise RemoteError(ErrorCode.BAD_REQUEST, "metadata must be a map")
    return metadata


def join_parts(parts: list[runtime_pb2.Tensor], expected: Any, peer_id: Optional[str] = None) -> runtime_pb2.Tensor:
    """Reassemble a streamed tensor, refusing a stream whose part count does not match."""
    if not isinstance(expected, int) or expected < 1:
        raise RemoteError(ErrorCode.BAD_REQUEST, f"metadata 'parts' must be a positive integer, got {expected!r}")
    if len(parts) != expected:
        raise RemoteError(ErrorCode.INCOMPLETE, f"stream ended after {len(parts)} of {expected} parts", peer_id)
    return parts[0] if expected == 1 else combine_from_streaming(parts)


def decode_tensor(proto: runtime_pb2.Tensor) -> torch.Tensor:
    try:
        return deserialize_torch_tensor(proto)
    except Exception as error:  # corrupt buffers raise ValueError, RuntimeError, TypeError...
        raise RemoteError(ErrorCode.BAD_REQUEST, f"cannot decode tensor: {error}") from None


def response_parts(hidden: torch.Tensor, wire_dtype: str, metadata: Optional[dict] = None,
                   second: Optional[torch.Tensor] = None,
                   receipt: Optional[Callable[[runtime_pb2.Tensor], dict]] = None) -> list[runtime_pb2.ExpertResponse]:
    """An answer's parts: ``hidden``, then a ``second`` tensor when given, exactly (for a backward call that carried
    an adapter tensor, its float32 gradient; for a sparse expert answer, its token ids). ``receipt`` gives the
    metadata that signs the encoded ``hidden`` (:mod:`swarm.wire.receipts`)."""
    extra = encode_tensor(second if not second.is_floating_point() else second.float(), "float32") \
        if second is not None else None
    main = encode_tensor(hidden, wire_dtype)
    messages, counts = packed_chunks(main, extra)
    meta = dict(metadata or {}, **counts, **(receipt(main) if receipt is not None else {}))
    parts = [runtime_pb2.ExpertResponse(tensors=messages[0], metadata=MSGPackSerializer.dumps(meta))]
    return parts + [runtime_pb2.ExpertResponse(tensors=tensors) for tensors in messages[1:]]


def error_response(error: RemoteError, metadata: Optional[dict] = None) -> runtime_pb2.ExpertResponse:
    hint = {"retry_after": round(error.retry_after, 3)} if error.retry_after is not None else {}
    meta = dict(metadata or {}, error={"code": error.code.value, "message": error.message, **hint})
    return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps(meta))


def ack_response(metadata: Optional[dict] = None) -> runtime_pb2.ExpertResponse:
    """The answer to a pushed request: accepted and computed; the output travels on to the next hop."""
    return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({**(metadata or {}), "pushed": True}))


def response_metadata(parts: list[runtime_pb2.ExpertResponse], peer_id: Optional[str] = None) -> dict:
    """The first part's metadata; a structured error in it is raised (naming ``failed_peer`` when given)."""
    if not parts:  # hivemind streams on loopback can lose messages, rarely, with several calls in flight
        raise RemoteError(ErrorCode.INCOMPLETE, "empty response", peer_id)
    metadata = parse_metadata(parts[0].metadata)
    check_error(metadata, metadata.get("failed_peer", peer_id))
    return metadata


def collect_ack(parts: list[runtime_pb2.ExpertResponse], peer_id: Optional[str] = None) -> tuple[None, dict]:
    metadata = response_metadata(parts, peer_id)
    if metadata.get("pushed") is not True:
        raise RemoteError(ErrorCode.INTERNAL, "server did not accept the push (an older version?)", peer_id)
    return None, metadata


def check_error(metadata: dict[str, Any], peer_id: Optional[str] = None) -> None:
    error = metadata.get("error")
    if error:
        error = error if isinstance(error, dict) else {"message": error}
        raise RemoteError(error.get("code", "internal"), str(error.get("message", "unknown error")), peer_id,
                          retry_after=error.get("retry_after"))


WIRE_ANSWER = "_wire_answer"  # a key no server sends: metadata of an answer read here, holding its wire form


def collect_response(parts: list[runtime_pb2.ExpertResponse],
                     peer_id: Optional[str] = None) -> tuple[torch.Tensor, dict]:
    """The answer's tensor; a second one (a deep prompt's gradient) is in the metadata under ``prompts``."""
    metadata = response_metadata(parts, peer_id)
    tensors = [t for part in parts for t in part.tensors]
    main, second = split_parts(tensors, metadata.get("parts"), metadata.get("prompt_parts"), peer_id)
    if second is not None:
        metadata["prompts"] = decode_tensor(join_parts(second, len(second), peer_id))
    answer = join_parts(main, metadata.get("parts"), peer_id)
    metadata[WIRE_ANSWER] = answer  # the answer as it travelled: what a receipt signs
    return decode_tensor(answer), metadata


def split_parts(tensors: list[runtime_pb2.Tensor], parts: Any, prompt_parts: Any, peer_id: Optional[str] = None
                ) -> tuple[list[runtime_pb2.Tensor], Optional[list[runtime_pb2.Tensor]]]:
    """The parts of the main tensor and of the deep prompt's (None when none was declared), their counts checked."""
    if prompt_parts is None:
        return tensors, None
    if not isinstance(parts, int) or not isinstance(prompt_parts, int) or parts < 1 or prompt_parts < 1:
        raise RemoteError(ErrorCode.BAD_REQUEST, f"metadata 'parts' and 'prompt_parts' must be positive integers, "
                          f"got {parts!r} and {prompt_parts!r}")
    if len(tensors) != parts + prompt_parts:
        raise RemoteError(ErrorCode.INCOMPLETE, f"stream ended after {len(tensors)} of {parts + prompt_parts} "
                          f"parts", peer_id)
    return tensors[:parts], tensors[parts:]


# ----- adapter files (swarm.adapters.sharing) ---------------------------------------------------------
def adapter_request(sha256: str) -> runtime_pb2.ExpertRequest:
    """Ask a server for the adapter files whose content hash is ``sha256``."""
    return runtime_pb2.ExpertRequest(uid="adapter", metadata=MSGPackSerializer.dumps({"sha256": sha256}))


def adapter_parts(files: dict[str, bytes]) -> list[runtime_pb2.ExpertResponse]:
    """Files as a stream: the first part names them with their sizes, the bytes follow in chunks."""
    data = b"".join(files.values())
    chunks = [data[i:i + STREAM_CHUNK_BYTES] for i in range(0, len(data), STREAM_CHUNK_BYTES)] or [b""]
    meta = {"files": [[name, len(content)] for name, content in files.items()], "parts": len(chunks)}
    tensors = [runtime_pb2.Tensor(buffer=chunk, dtype="uint8", size=[len(chunk)]) for chunk in chunks]
    return [runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps(meta) if i == 0 else b"", tensors=[t])
            for i, t in enumerate(tensors)]


def adapter_declared(metadata: dict, max_bytes: int, peer_id: Optional[str] = None) -> list[tuple[str, int]]:
    """The (name, size) list a server's first part declares, refused when malformed or over ``max_bytes``."""
    files = metadata.get("files")
    if not isinstance(files, list) or not 0 < len(files) <= 8 or not all(
            isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and isinstance(f[1], int) and f[1] >= 0
            for f in files):
        raise RemoteError(ErrorCode.BAD_REQUEST, "the answer must declare its files as [[name, size], ...]", peer_id)
    total = sum(size for _, size in files)
    if total > max_bytes:
        raise RemoteError(ErrorCode.TOO_LARGE, f"the server declares {total} bytes of adapter files, over the "
                          f"{max_bytes} expected", peer_id)
    return [(name, size) for name, size in files]


async def _send_error(writer: asyncio.StreamWriter, error: Exception) -> bool:
    """Tell a stream's caller why it ends (hivemind's stubs raise it); False when the caller is gone."""
    try:
        await P2P.send_protobuf(RPCError(message=str(error)), writer)
        return True
    except Exception:
        return False
