"""A server's libp2p identity doubles as its DHT signing key, so its records prove the peer id they speak for.

hivemind's libp2p identity file holds an RSA key, and the peer id is the sha256 multihash of its protobuf public
key. A server signs its DHT records with that same key (``RSASignatureValidator``) under the subkey
``{peer id}[owner:ssh-rsa ...]``; anyone can then derive the peer id from the owner key in the subkey
(:func:`peer_id_from_owner_key`) and check it against the peer id before the tag.
"""
from __future__ import annotations

import functools
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from swarm.utils.peer_keys import MAX_OWNER_KEY_BYTES, peer_id_from_owner_key  # noqa: F401 (read here too)

logger = logging.getLogger(__name__)

TEMPORARY_PREFIX = "swarm-identity-"
def rsa_key_from_identity(data: bytes, source: str = "identity") -> RSAPrivateKey:
    """hivemind's RSA key object from the bytes of a libp2p identity file (protobuf ``PrivateKey``)."""
    try:
        message = crypto_pb2.PrivateKey.FromString(data)
    except Exception as error:  # protobuf raises its own DecodeError
        raise ValueError(f"{source} is not a libp2p private key file: {error}") from None
    if message.key_type != crypto_pb2.RSA:
        kind = crypto_pb2.KeyType.Name(message.key_type)
        raise ValueError(f"{source} holds a {kind} key; servers need an RSA identity (as hivemind creates one)")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": message.data})  # hivemind's own unpickling path: DER, no new key generated
    return key


@dataclass
class Identity:
    """The key file the libp2p daemon runs with, and the same key for signing DHT records.

    ``temporary`` identities live in a private directory that :meth:`remove` deletes (the daemon reads the
    file once at start). ``fresh`` ones were created here, so nobody else can be using them.
    """

    path: Path
    private_key: RSAPrivateKey
    peer_id: str
    temporary: bool = False
    fresh: bool = False

    def __post_init__(self) -> None:
        if self.temporary and not self.path.parent.name.startswith(TEMPORARY_PREFIX):
            raise ValueError(f"refusing to treat {self.path} as a temporary identity")  # remove() deletes the folder

    @classmethod
    def load_or_create(cls, path: Optional[str | Path] = None) -> "Identity":
        """Load ``path`` (creating it if missing), or create a temporary identity when no path is given."""
        temporary, fresh = path is None, False
        if temporary:
            path = Path(tempfile.mkdtemp(prefix=TEMPORARY_PREFIX)) / "identity.key"  # mkdtemp: mode 0700
        path = Path(path)
        if not path.exists():
            P2P.generate_identity(str(path))  # the same format and mode (0400) as hivemind's own
            fresh = True
            logger.info("created %s identity %s", "a temporary" if temporary else "a new", path)
        data = path.read_bytes()
        key = rsa_key_from_identity(data, str(path))
        return cls(path, key, PeerID.from_identity(data).to_base58(), temporary, fresh)

    @functools.cached_property
    def validator(self) -> RSASignatureValidator:
        """hivemind's signing validator with this identity's key (one per identity)."""
        return RSASignatureValidator(self.private_key)

    def owner_subkey(self) -> bytes:
        """The subkey this identity writes under: its peer id followed by its owner tag."""
        return self.peer_id.encode() + self.validator.local_public_key

    def remove(self) -> None:
        """Delete a temporary identity file and its directory (no-op otherwise, and when already gone)."""
        if self.temporary and self.path.parent.exists():
            shutil.rmtree(self.path.parent, ignore_errors=True)
            logger.debug("removed temporary identity %s", self.path)
