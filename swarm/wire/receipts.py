"""Receipts: a server's signature on every span answer it gives, binding the request it read to the answer it sent
(issue 55, "audits of real traffic").

An audit that a server can tell apart from real use (a fresh identity, a lone pass) is passed by a server that lies
only to long-seen callers or only on rows merged across clients. Receipts move the audit onto the real calls: each
answer carries a :class:`Receipt`, the server's libp2p peer key (RSA, the key its peer id is the hash of) signing

* ``request``: a digest of what the call asked (blocks, session, step, cache and head directives, the adapter's
  digest, and the hidden states exactly as they travelled: dtype, shape, compression and bytes);
* ``answer``: a digest of the answer's tensor exactly as it travelled;
* ``fill``: for a reuse of the activation cache, the ``request`` digest of the fill the server reused;
* ``prefix`` (the model) and what its numerics are (``exact``: the checkpoint's dtype, unquantized; ``invariant``:
  batch-invariant passes), so a verifier knows which model to recompute and how closely.

A client checks each receipt when the answer arrives (signature, peer id, both digests: one RSA verification and two
sha256 over bytes it already holds) and keeps them (:mod:`swarm.audit.evidence`); with the call's tensors a receipt
becomes evidence that anyone holding the blocks can recompute. Costs: one RSA-2048 signature per answer on the
server (about 1 ms), about 700 bytes of metadata per answer (the key travels in each receipt, so a receipt is
self-contained).
"""
from __future__ import annotations

import base64
import hashlib
import time
from dataclasses import dataclass
from typing import Any, Optional

import msgpack
from hivemind.proto import runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from swarm.utils import fields
from swarm.utils.peer_keys import MAX_OWNER_KEY_BYTES, peer_id_from_owner_key

RECEIPT_VERSION = 1
DIGEST_BYTES = 32
MAX_SIGNATURE_BYTES = 1024  # base64 of an RSA-4096 signature is 684 bytes
MAX_PREFIX_CHARS = 256
CALL_TAG = b"swarm-call-v1"
TENSOR_TAG = b"swarm-tensor-v1"
RECEIPT_TAG = b"swarm-receipt-v1"


def tensor_digest(proto: runtime_pb2.Tensor) -> bytes:
    """sha256 of a tensor as it travels (dtype, shape, compression, bytes): both ends compute it from the wire form,
    so no re-encoding decides it."""
    header = f"{proto.dtype}|{','.join(str(size) for size in proto.size)}|{int(proto.compression)}|".encode()
    hasher = hashlib.sha256(TENSOR_TAG)
    hasher.update(header)
    hasher.update(proto.buffer)
    return hasher.digest()


def canonical(value: Any) -> Any:
    """``value`` with every map's keys sorted and tuples as lists: one msgpack encoding for one meaning."""
    if isinstance(value, dict):
        return {key: canonical(value[key]) for key in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [canonical(item) for item in value]
    return value


@dataclass(frozen=True)
class CallContent:
    """What a span call asked, as both ends read it: the parts a request digest covers."""

    start: int
    end: int
    session_id: str
    step: int
    cache: Optional[dict]  # CacheDirective.to_dict()
    head: Optional[dict]  # HeadQuery.to_dict()
    adapter_kind: Optional[str]
    adapter_digest: Optional[str]  # BlockAdapter.digest() of the adapter's float32 weights
    hidden: bytes  # tensor_digest of the hidden states as they travelled

    def digest(self) -> bytes:
        fields_ = [CALL_TAG.decode(), self.start, self.end, self.session_id, self.step, self.cache, self.head,
                   self.adapter_kind, self.adapter_digest, self.hidden]
        return hashlib.sha256(msgpack.packb(canonical(fields_), use_bin_type=True)).digest()


@dataclass(frozen=True)
class Receipt:
    """A server's signed statement: for model ``prefix``, to the call with digest ``request`` it answered ``answer``
    (see the module doc). ``owner_key`` is its ssh-rsa public key; the peer id is derived from it, never taken."""

    prefix: str
    request: bytes
    answer: bytes
    fill: bytes  # the reused fill's request digest; b"" for a call that reuses no cache
    exact: bool
    invariant: bool
    issued: float  # the server's clock, seconds since the epoch
    owner_key: bytes
    signature: bytes = b""

    @property
    def peer_id(self) -> Optional[str]:
        return peer_id_from_owner_key(self.owner_key)

    def signed_bytes(self) -> bytes:
        body = [RECEIPT_TAG.decode(), RECEIPT_VERSION, self.prefix, self.request, self.answer, self.fill,
                self.exact, self.invariant, self.issued, self.owner_key]
        return msgpack.packb(body, use_bin_type=True)

    def valid_signature(self) -> bool:
        """The signature holds for ``owner_key`` (which names the peer id)."""
        try:
            return RSAPublicKey.from_bytes(self.owner_key).verify(self.signed_bytes(), self.signature)
        except Exception:  # a key that is not an RSA ssh key, a signature that is not base64
            return False

    def to_wire(self) -> dict[str, Any]:
        return {"v": RECEIPT_VERSION, "prefix": self.prefix, "q": self.request, "a": self.answer, "f": self.fill,
                "exact": self.exact, "inv": self.invariant, "t": self.issued, "key": self.owner_key,
                "sig": self.signature}

    @classmethod
    def from_wire(cls, raw: Any) -> "Receipt":
        """A receipt from remote input: every field checked and bounded (ValueError otherwise). The signature is
        checked separately (:meth:`valid_signature`)."""
        if not isinstance(raw, dict) or set(raw) != set(cls.WIRE_FIELDS):
            raise ValueError("a receipt is a map of exactly the fields " + ", ".join(cls.WIRE_FIELDS))
        fields.integer(raw["v"], RECEIPT_VERSION, RECEIPT_VERSION)
        request, answer = digest_bytes(raw["q"]), digest_bytes(raw["a"])
        fill = raw["f"]
        if fill != b"":
            fill = digest_bytes(fill)
        key, signature = raw["key"], raw["sig"]
        if not isinstance(key, bytes) or not 0 < len(key) <= MAX_OWNER_KEY_BYTES:
            raise ValueError("a receipt's key is the server's ssh-rsa public key")
        if not isinstance(signature, bytes) or not 0 < len(signature) <= MAX_SIGNATURE_BYTES:
            raise ValueError(f"a receipt's signature is at most {MAX_SIGNATURE_BYTES} bytes")
        prefix = raw["prefix"]
        if not isinstance(prefix, str) or not 0 < len(prefix) <= MAX_PREFIX_CHARS:
            raise ValueError("a receipt names its model prefix")
        return cls(prefix, request, answer, fill, fields.flag(raw["exact"]), fields.flag(raw["inv"]),
                   fields.number(raw["t"], 0.0, 2.0**40), key, signature)

    WIRE_FIELDS = ("v", "prefix", "q", "a", "f", "exact", "inv", "t", "key", "sig")


def digest_bytes(raw: Any) -> bytes:
    if not isinstance(raw, bytes) or len(raw) != DIGEST_BYTES:
        raise ValueError(f"expected a {DIGEST_BYTES}-byte digest")
    return raw


class ReceiptSigner:
    """A server's receipts, signed with its peer key (see the module doc)."""

    def __init__(self, private_key: RSAPrivateKey, prefix: str, exact: bool, invariant: bool):
        self.private_key, self.prefix, self.exact, self.invariant = private_key, prefix, exact, invariant
        self.owner_key = private_key.get_public_key().to_bytes()
        self.signed = 0

    def sign(self, request: bytes, answer: bytes, fill: bytes = b"") -> Receipt:
        receipt = Receipt(self.prefix, request, answer, fill, self.exact, self.invariant, round(time.time(), 3),
                          self.owner_key)
        self.signed += 1
        return Receipt(**{**receipt.__dict__, "signature": self.private_key.sign(receipt.signed_bytes())})


def short(digest: bytes) -> str:
    """A digest as a short text for logs and reasons."""
    return base64.b16encode(digest[:6]).decode().lower()
