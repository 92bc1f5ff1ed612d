"""A libp2p peer id from the RSA public key that signs for it: DHT records (:mod:`swarm.dht.validation`) and the
servers' signed receipts (:mod:`swarm.wire.receipts`) both name their signer this way."""
from __future__ import annotations

import functools
import hashlib
from typing import Optional

import multihash
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

MAX_OWNER_KEY_BYTES = 4096  # an ssh-rsa line of a 2048-bit key is ~380 bytes; longer ones are refused unparsed


@functools.lru_cache(maxsize=4096)
def peer_id_from_owner_key(ssh_key: bytes) -> Optional[str]:
    """The libp2p peer id of an ``ssh-rsa ...`` public key, or None if it is not one (cached: readers call it often)."""
    if len(ssh_key) > MAX_OWNER_KEY_BYTES:
        return None
    try:
        public = serialization.load_ssh_public_key(ssh_key)
    except (ValueError, UnsupportedAlgorithm):
        return None
    if not isinstance(public, rsa.RSAPublicKey):
        return None
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()
