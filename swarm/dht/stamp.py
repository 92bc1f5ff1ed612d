"""Work stamps: what a new entry in a shared DHT list costs its writer (issue 55).

A shared list (the publishers of a model name, the authors of a prefix's adapters) is bounded at each storing peer, and
anyone can make Ed25519 keys for free: without a price, a few seconds of signing fill it. So every entry of a shared
list carries a *stamp*: an 8-byte nonce such that sha256(domain, the key's hash, the slot's signer, nonce) starts with
:func:`required_bits` zero bits. Checking one is a single sha256 (about a microsecond); making one takes 2**bits hashes
on average. The stamp names the key and the signer, so it is made once per (list, key) and reused for every update
(kept in memory and in ``~/.cache/swarm/stamps``), and it cannot be moved to another list or signer.

The default, :data:`DEFAULT_STAMP_BITS` (26), costs an honest writer about 2**26 hashes once per list (about a minute
on one core in Python: docs/GOVERNANCE.md gives the figures measured) and an attacker filling a 64-entry list 64
times that on CPUs (over an hour). Hardware built for sha256 does it far faster: the stamp prices floods from
commodity CPUs, and the lists stay what they were, a place where strangers are found; where a reader needs a
particular signer's entry it reads that signer's own key, which no stamp guards because no other key can write it
(``swarm.dht.keys``).
``$SWARM_STAMP_BITS`` sets the difficulty of this process (a storing peer refuses stamps below its own; tests use a
small one).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

from swarm.utils.hashcash import leading_zero_bits

logger = logging.getLogger(__name__)

STAMP_DOMAIN = b"swarm-stamp-v1"
STAMP_BYTES = 8
STAMP_FIELD = "stamp"  # the field of a slot value carrying its stamp
DEFAULT_STAMP_BITS = 26  # an honest writer: about a minute of one core once per list; a 64-slot flood: an hour
MAX_STAMP_BITS = 40
ENV_STAMP_BITS = "SWARM_STAMP_BITS"
ENV_STAMP_CACHE = "SWARM_STAMP_CACHE"

_made: dict[tuple[bytes, str, int], bytes] = {}


def required_bits() -> int:
    """The difficulty of this process: ``$SWARM_STAMP_BITS`` (0-40) or :data:`DEFAULT_STAMP_BITS`."""
    text = os.environ.get(ENV_STAMP_BITS, "").strip()
    if not text:
        return DEFAULT_STAMP_BITS
    if not text.isdigit() or int(text) > MAX_STAMP_BITS:
        raise ValueError(f"${ENV_STAMP_BITS} must be a whole number of bits from 0 to {MAX_STAMP_BITS}, not {text!r}")
    return int(text)


def _base(key_id: bytes, signer: str) -> "hashlib._Hash":
    return hashlib.sha256(STAMP_DOMAIN + len(key_id).to_bytes(2, "big") + key_id + signer.encode())


def stamp_refusal(key_id: bytes, signer: str, stamp: Any, bits: int) -> Optional[str]:
    """Why ``stamp`` does not admit ``signer``'s slot under the key hashed ``key_id`` at ``bits``, or None. Any value
    from the network may arrive here: it never raises."""
    if bits <= 0:
        return None
    if not isinstance(stamp, bytes) or len(stamp) != STAMP_BYTES:
        return f"no work stamp ({STAMP_BYTES} bytes; this list admits an entry for {bits} bits of work)"
    digest = _base(key_id, signer)
    digest.update(stamp)
    if leading_zero_bits(digest.digest()) < bits:
        return f"a work stamp below {bits} bits"
    return None


def make_stamp(key_id: bytes, signer: str, bits: int, cache_dir: Optional[Path] = None) -> bytes:
    """A stamp of at least ``bits`` for ``signer``'s slot under the key hashed ``key_id``: from memory, from the cache
    directory, or made now (2**bits hashes on average; logged when it takes long)."""
    memo = (key_id, signer, bits)
    if memo in _made:
        return _made[memo]
    path = _cache_path(key_id, signer, bits, cache_dir)
    try:
        stamp = path.read_bytes()
        if stamp_refusal(key_id, signer, stamp, bits) is None:
            _made[memo] = stamp
            return stamp
    except OSError:
        pass
    started, base, nonce = time.monotonic(), _base(key_id, signer), 0
    if bits >= 20:
        logger.info("making a work stamp of %d bits for a shared list entry (once per list and key)...", bits)
    while True:
        candidate = nonce.to_bytes(STAMP_BYTES, "little")
        digest = base.copy()
        digest.update(candidate)
        if leading_zero_bits(digest.digest()) >= bits:
            break
        nonce += 1
    if bits >= 20:
        logger.info("work stamp made in %.1f s (%d hashes)", time.monotonic() - started, nonce + 1)
    _made[memo] = candidate
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(candidate)
    except OSError as error:  # a read-only home: the stamp is made again next time, nothing else is lost
        logger.debug("could not keep the work stamp in %s: %s", path, error)
    return candidate


def _cache_path(key_id: bytes, signer: str, bits: int, cache_dir: Optional[Path]) -> Path:
    directory = cache_dir or Path(os.environ.get(ENV_STAMP_CACHE) or Path.home() / ".cache" / "swarm" / "stamps")
    return directory / f"{hashlib.sha256(key_id + signer.encode()).hexdigest()[:32]}-{bits}"
