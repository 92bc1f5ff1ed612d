"""Evidence: one real span call, self-contained, that anyone holding the blocks can recompute (issue 55).

A client keeps a sample of its calls with their receipts (:mod:`swarm.wire.receipts`); each becomes a
:class:`CallEvidence`: the receipt, the call's content (blocks, session, step, cache and head directives, the adapter's
weights) and the hidden states and the answer exactly as they travelled. For a reuse of the activation cache it
carries the fill the server reused, with the fill's own receipt. Whoever recomputes it (an auditor, another holder of
the blocks, a client with the checkpoint: :func:`swarm.client.proofs.verify_evidence`) learns whether the server
answered honestly; a wrong answer makes the same bytes a *proof*: the server's own signature binds it to the request
and to the wrong answer, so nobody has to take the prover's word.

Evidence is remote input: :meth:`CallEvidence.from_bytes` reads at most :data:`MAX_EVIDENCE_BYTES`, every field
typed and bounded, tensors checked against their declared dtype and shape before they are decoded (ValueError
otherwise). What it shows: the call's hidden states, which encode the prompt; a client shares only what it chooses
(``DistributedDiffusionLM.private_calls``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import msgpack
import torch
from hivemind.proto import runtime_pb2

from swarm.adapters.block import BlockAdapter
from swarm.diffusion.pipeline import CacheDirective
from swarm.utils import fields
from swarm.wire.encoding import decode_tensor, encode_tensor
from swarm.wire.messages import ForwardRequest, RemoteError
from swarm.wire.receipts import CallContent, Receipt, tensor_digest

EVIDENCE_VERSION = 1
MAX_EVIDENCE_BYTES = 160 * 2**20  # a 2,048-row call of an 8B model in float32, both ways, with room
MAX_ELEMENTS = 2**28
MAX_DIM = 2**24
MAX_SESSION_CHARS = 256
MAX_STEP = 2**31
ELEMENT_BYTES = {("float32", int(runtime_pb2.CompressionType.NONE)): 4,
                 ("float32", int(runtime_pb2.CompressionType.FLOAT16)): 2,
                 ("bfloat16", int(runtime_pb2.CompressionType.NONE)): 2,
                 ("float16", int(runtime_pb2.CompressionType.NONE)): 2,
                 ("float64", int(runtime_pb2.CompressionType.NONE)): 8}
ADAPTER_KINDS = ("deep_prompt", "bottleneck", "lora")


def tensor_map(proto: runtime_pb2.Tensor) -> dict[str, Any]:
    return {"dtype": proto.dtype, "size": list(proto.size), "compression": int(proto.compression),
            "buffer": bytes(proto.buffer)}


def tensor_proto(raw: Any, dims: tuple[int, ...]) -> runtime_pb2.Tensor:
    """A tensor's wire form from remote input, its bytes checked against its dtype and shape (``dims``: the number
    of dimensions allowed)."""
    if not isinstance(raw, dict) or set(raw) != {"dtype", "size", "compression", "buffer"}:
        raise ValueError("a tensor is a map of dtype, size, compression and buffer")
    dtype, size, compression, buffer = raw["dtype"], raw["size"], raw["compression"], raw["buffer"]
    known = isinstance(dtype, str) and type(compression) is int  # noqa: E721 (a bool is no compression code)
    element = ELEMENT_BYTES.get((dtype, compression)) if known else None
    if element is None:
        raise ValueError(f"a tensor's dtype and compression must be one of {sorted(ELEMENT_BYTES)}")
    if not isinstance(size, list) or len(size) not in dims:
        raise ValueError(f"a tensor here has {' or '.join(map(str, dims))} dimensions")
    shape = [fields.integer(n, 1, MAX_DIM) for n in size]
    if math.prod(shape) > MAX_ELEMENTS or not isinstance(buffer, bytes) or len(buffer) != math.prod(shape) * element:
        raise ValueError(f"a tensor's bytes must be its {math.prod(shape)} elements of {element} bytes")
    return runtime_pb2.Tensor(dtype=dtype, size=shape, compression=compression, buffer=buffer)


def decoded(proto: runtime_pb2.Tensor) -> torch.Tensor:
    try:
        tensor = decode_tensor(proto)
    except RemoteError as error:
        raise ValueError(error.message) from None
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ValueError("a tensor holds NaN or infinite values")
    return tensor


def head_map(raw: Any) -> Optional[dict]:
    """A head query as the request carried it: a small map of scalars and lists of scalars (it is parsed against
    the model where the call is recomputed)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or len(raw) > 16:
        raise ValueError("a head query is a map of at most 16 fields")
    return {fields.text(key, 32): fields.small_value(value, 64, depth=1, max_items=4096) for key, value in raw.items()}


def cache_directive(raw: Any, length: int) -> Optional[CacheDirective]:
    """A call's cache directive (as :meth:`CacheDirective.to_dict` writes it), bounded."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"rows", "version", "keep_from"}:
        raise ValueError("a cache directive is a map of rows, version and keep_from")
    version = fields.integer(raw["version"], 0, MAX_STEP)
    keep_from = fields.integer(raw["keep_from"], 0, version)
    rows = raw["rows"]
    if rows is None:
        return CacheDirective(version, None, keep_from)
    if not isinstance(rows, list) or len(rows) != 2:
        raise ValueError("a reuse's rows are [start, end]")
    first = fields.integer(rows[0], 0, MAX_DIM)
    if fields.integer(rows[1], first + 1, MAX_DIM) - first != length:
        raise ValueError("a reuse's rows must be the positions sent")
    return CacheDirective(version, (first, rows[1]), keep_from)


@dataclass(frozen=True)
class CallEvidence:
    """One span call with its receipt (see the module doc). ``head`` is the head query as the request carried it
    (parsed against the model where it is recomputed); ``answer`` is None only for a reuse's ``fill``, whose answer
    nobody needs."""

    receipt: Receipt
    start: int
    end: int
    session_id: str
    step: int
    cache: Optional[CacheDirective]
    head: Optional[dict]
    adapter: Optional[BlockAdapter]
    hidden: runtime_pb2.Tensor
    answer: Optional[runtime_pb2.Tensor]
    fill: Optional["CallEvidence"] = None

    @property
    def accused(self) -> Optional[str]:
        return self.receipt.peer_id

    def content(self, adapter_digest: Optional[str] = None) -> CallContent:
        adapter = self.adapter
        return CallContent(self.start, self.end, self.session_id, self.step,
                           self.cache.to_dict() if self.cache is not None else None, self.head,
                           adapter.kind if adapter is not None else None,
                           adapter_digest or (adapter.digest() if adapter is not None else None),
                           tensor_digest(self.hidden))

    def request(self, head: Any = None) -> ForwardRequest:
        """The call as a request (``head``: its parsed head query)."""
        return ForwardRequest(self.start, self.end, decoded(self.hidden), self.session_id, self.step,
                              cache=self.cache, head=head, adapter=self.adapter)

    def problem(self, prefix: str) -> Optional[str]:
        """Why this is not the accused server's signed statement about this call (None when it is): signatures,
        digests, the model, and for a reuse, the fill it names."""
        receipt = self.receipt
        if receipt.prefix != prefix:
            return f"the receipt is for model {receipt.prefix!r}, not {prefix!r}"
        if receipt.peer_id is None or not receipt.valid_signature():
            return "the receipt's signature does not hold"
        if self.content().digest() != receipt.request:
            return "the call is not the one the receipt signs"
        if self.answer is not None and tensor_digest(self.answer) != receipt.answer:
            return "the answer is not the one the receipt signs"
        reuse = self.cache is not None and not self.cache.fill
        if not reuse:
            return "a call that reuses no cache carries no fill" if self.fill is not None else None
        fill = self.fill
        if fill is None or fill.cache is None or not fill.cache.fill:
            return "a reuse must carry the fill it reused"
        if fill.receipt.owner_key != receipt.owner_key or receipt.fill != fill.receipt.request:
            return "the fill is not the one the reuse's receipt names"
        if (fill.start, fill.end, fill.session_id, fill.cache.version) != (self.start, self.end, self.session_id,
                                                                           self.cache.version):
            return "the fill is for other blocks, another session or another version"
        if (fill.adapter is None) != (self.adapter is None) or fill.adapter is not None and \
                fill.adapter.digest() != self.adapter.digest():
            return "the fill carried another adapter than the reuse"
        problem = fill.problem(prefix)
        return f"fill: {problem}" if problem else None

    # ----- bytes -------------------------------------------------------------------------------------
    def to_map(self) -> dict[str, Any]:
        adapter = self.adapter
        return {"v": EVIDENCE_VERSION, "receipt": self.receipt.to_wire(), "start": self.start, "end": self.end,
                "session": self.session_id, "step": self.step,
                "cache": self.cache.to_dict() if self.cache is not None else None, "head": self.head,
                "adapter_kind": adapter.kind if adapter is not None else None,
                "adapter": tensor_map(encode_weights(adapter)) if adapter is not None else None,
                "hidden": tensor_map(self.hidden),
                "answer": tensor_map(self.answer) if self.answer is not None else None,
                "fill": self.fill.to_map() if self.fill is not None else None}

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_map(), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> "CallEvidence":
        """Evidence from remote bytes (ValueError for anything but well-formed, bounded evidence)."""
        if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_EVIDENCE_BYTES:
            raise ValueError(f"evidence is at most {MAX_EVIDENCE_BYTES} bytes")
        try:
            raw = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, max_bin_len=MAX_EVIDENCE_BYTES,
                                  max_str_len=4096, max_array_len=4096, max_map_len=64, max_ext_len=0)
        except Exception as error:  # msgpack raises several unrelated types on garbage
            raise ValueError(f"evidence is not valid msgpack ({type(error).__name__})") from None
        return cls.from_map(raw, fill_allowed=True)

    FIELDS = ("v", "receipt", "start", "end", "session", "step", "cache", "head", "adapter_kind", "adapter",
              "hidden", "answer", "fill")

    @classmethod
    def from_map(cls, raw: Any, fill_allowed: bool) -> "CallEvidence":
        if not isinstance(raw, dict) or set(raw) != set(cls.FIELDS):
            raise ValueError("evidence is a map of exactly the fields " + ", ".join(cls.FIELDS))
        fields.integer(raw["v"], EVIDENCE_VERSION, EVIDENCE_VERSION)
        start = fields.integer(raw["start"], 0, 4096)
        end = fields.integer(raw["end"], start + 1, 4096)
        session = raw["session"]
        if not isinstance(session, str) or len(session) > MAX_SESSION_CHARS:
            raise ValueError(f"a session id is a text of at most {MAX_SESSION_CHARS} characters")
        step = fields.integer(raw["step"], -1, MAX_STEP)
        hidden = tensor_proto(raw["hidden"], (3,))
        if fill_allowed:
            answer = tensor_proto(raw["answer"], (3,))
        elif raw["answer"] is not None:
            raise ValueError("a reuse's fill carries no answer")
        else:
            answer = None
        head = head_map(raw["head"])
        adapter = None
        if raw["adapter"] is not None or raw["adapter_kind"] is not None:
            if raw["adapter_kind"] not in ADAPTER_KINDS:
                raise ValueError(f"an adapter's kind is one of {', '.join(ADAPTER_KINDS)}")
            weights = decoded(tensor_proto(raw["adapter"], (3,)))
            if weights.shape[0] != end - start:
                raise ValueError("an adapter carries one slice per block of the call")
            adapter = BlockAdapter(raw["adapter_kind"], weights.float())
        fill = None
        if raw["fill"] is not None:
            if not fill_allowed:
                raise ValueError("a fill carries no fill of its own")
            fill = cls.from_map(raw["fill"], fill_allowed=False)
        return cls(Receipt.from_wire(raw["receipt"]), start, end, session, step,
                   cache_directive(raw["cache"], int(hidden.size[1])), head, adapter, hidden, answer, fill)

    def without_answer(self) -> "CallEvidence":
        return dataclasses.replace(self, answer=None, fill=None)


def encode_weights(adapter: BlockAdapter) -> runtime_pb2.Tensor:
    """An adapter's weights as they travel: float32, unrounded."""
    return encode_tensor(adapter.weights.float(), "float32")
