"""What a work stamp costs (``swarm.dht.stamp``, issue 55): the storing peer's check and the writer's making.

    python benchmarks/stamp_cost.py [--bits 16] [--repeat 5]

Prints, on this machine as loaded now: the time to check one stamp (best of ``--repeat`` runs of 10,000 checks), the
time per hash of the making loop (best of ``--repeat`` runs of 2**18 hashes), the measured time to make stamps of
``--bits`` bits (the mean of 16 stamps), and what that gives at the default difficulty: one honest writer joining a
shared list, and an attacker filling a 32- and a 64-slot list, in CPU time on this machine's cores. Say the load
(``uptime``) beside the figures.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
import timeit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=16, help="bits of the stamps made and timed whole")
    parser.add_argument("--repeat", type=int, default=5, help="best of this many runs for the check and the hash")
    args = parser.parse_args()
    os.environ["SWARM_STAMP_CACHE"] = tempfile.mkdtemp(prefix="stamp-bench-")  # made, not read from a cache
    from swarm.dht.stamp import DEFAULT_STAMP_BITS, _base, leading_zero_bits, make_stamp, stamp_refusal

    key_id, signer = os.urandom(20), "A" * 43 + "="
    stamp = make_stamp(key_id, signer, 12)
    check = min(timeit.repeat(lambda: stamp_refusal(key_id, signer, stamp, 12), number=10_000,
                              repeat=args.repeat)) / 10_000
    base = _base(key_id, signer)

    def hashes(count: int) -> None:
        for nonce in range(count):
            digest = base.copy()
            digest.update(nonce.to_bytes(8, "little"))
            leading_zero_bits(digest.digest())

    per_hash = min(timeit.repeat(lambda: hashes(2**18), number=1, repeat=args.repeat)) / 2**18
    started = time.perf_counter()
    for _ in range(16):
        make_stamp(os.urandom(20), signer, args.bits)
    made = (time.perf_counter() - started) / 16
    honest = per_hash * 2**DEFAULT_STAMP_BITS
    print(f"check one stamp: {check * 1e6:.2f} us")
    print(f"one hash of the making loop: {per_hash * 1e9:.0f} ns")
    print(f"make a {args.bits}-bit stamp: {made:.3f} s measured (mean of 16), {per_hash * 2**args.bits:.3f} s "
          f"expected from the hash rate")
    print(f"at the default {DEFAULT_STAMP_BITS} bits: an honest writer joining one shared list {honest / 60:.1f} min "
          f"of one core (once per list and key); an attacker filling 32 slots {32 * honest / 3600:.1f} h, "
          f"64 slots {64 * honest / 3600:.1f} h of one core")


if __name__ == "__main__":
    main()
