"""What a hashcash-style proof of work counts: the leading zero bits of a digest (the DHT's work stamps,
:mod:`swarm.dht.stamp`, and the calls' work stamps, :mod:`swarm.wire.stamp_value`, both price work by it)."""
from __future__ import annotations


def leading_zero_bits(digest: bytes) -> int:
    value = int.from_bytes(digest, "big")
    return len(digest) * 8 - value.bit_length()
