"""Ed25519 governance keys: the private key signs halt / resume records, public keys verify them."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarm.dht.validation import ed25519_public_key, ed25519_text

ENV_PUBLIC_KEYS = "SWARM_GOVERNANCE_KEYS"


def generate_private_key(path: str | Path) -> Ed25519PrivateKey:
    """Create a key file readable only by its owner; refuses to overwrite an existing one."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} already exists; refusing to overwrite a governance key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(pem)
    return key


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key")
    return key


def load_key_file(path: str | Path, role: str = "governance") -> Ed25519PrivateKey:
    """The Ed25519 private key in ``path`` (a governance or an auditor key); a ValueError in one line saying what the
    file is instead (missing, a public key, not a key) and what to give."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is no file: create a key with `python -m swarm.governance keygen --out {path}`")
    try:
        return load_private_key(path)
    except Exception:  # cryptography raises ValueError, TypeError or UnsupportedAlgorithm for what is no such key
        try:
            parse_public_key(str(path))
        except ValueError:
            hint = "a PEM file made by `python -m swarm.governance keygen`"
        else:
            hint = f"it holds a public key; give the private key file ({path.name.removesuffix('.pub')})"
        raise ValueError(f"{path} is not {'an' if role[0] in 'aeiou' else 'a'} {role} private key: {hint}") from None


def public_key_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The public key as one base64 line: what operators publish and servers are configured with."""
    return ed25519_text(key)


def parse_public_key(text: str) -> Ed25519PublicKey:
    """A base64 public key, or a path to a file holding one."""
    try:
        candidate = Path(text).expanduser()
        is_file = candidate.is_file()
    except (RuntimeError, OSError, ValueError):  # "~nobody" (no such user's home), a name too long, a NUL byte
        is_file = False
    if is_file:
        text = candidate.read_text().strip()
    try:
        return ed25519_public_key(text)
    except ValueError as error:
        raise ValueError(f"not an Ed25519 public key (base64) or a file holding one: {text[:60]!r}") from error


def public_keys_from_env() -> list[str]:
    return [k for k in os.environ.get(ENV_PUBLIC_KEYS, "").replace(",", " ").split() if k]


def trusted_key_texts(keys: Iterable[str] = ()) -> list[str]:
    """The trusted keys as given (base64 or files), else ``$SWARM_GOVERNANCE_KEYS``."""
    return list(keys) or public_keys_from_env()


def trusted_signers(keys: Iterable[str] = ()) -> list[str]:
    """The trusted keys as the base64 text their slots name (what storing peers keep under the governance key)."""
    return [public_key_text(parse_public_key(k)) for k in trusted_key_texts(keys)]
