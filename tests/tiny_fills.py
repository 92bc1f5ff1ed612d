"""The activation cache's real cost, measured in a process of its own (tests/test_security_server.py starts it).

Kept apart from the test file so that the measuring process imports only torch, the model's blocks and the cache
(the test file's imports, hivemind's among them, cost it 1.2 CPU s more).
"""
from __future__ import annotations

import ctypes
import gc
from unittest import mock

import torch

from swarm.models.modules import BlockSpan
from swarm.server import session_cache
from swarm.server.session_cache import SessionCaches
from swarm.testing.checkpoints import tiny_config

HIDDEN = 32  # tiny_config's hidden size
FILL_BUDGET = 2 * 2**20  # the cache's budget for the fills: what is measured scales with it (4 MiB and 3,500 fills cost
# twice the CPU and proved the same)
FILLS = 1750  # twice the 862 versions the budget holds at their real cost, so the later half all evict. Counted at
# their tensors' 128 bytes only (the accounting this replaced) all 1,750 are kept and hold about 3 MB, over the budget


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_held_bytes() -> int:
    """Bytes that malloc has handed out and not had back (glibc's ``mallinfo2``): what a process really holds,
    without the freed-but-kept pages and the fragmentation that make its resident size move by megabytes
    between identical runs. With ``PYTHONMALLOC=malloc`` Python's objects are counted too."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def measure_tiny_fills(count_overhead: bool = True) -> dict:
    """``FILLS`` one-position fills, each a new session, as a flood would send them; checks what the cache counts
    and returns the bytes the process holds for them. ``count_overhead=False`` counts the tensors alone (the old
    accounting), to show that the measurement catches it."""
    config = tiny_config()
    span = BlockSpan(config, 0, 1).eval()
    budget = FILL_BUDGET
    hidden = torch.randn(1, 1, HIDDEN)
    entry_overhead = session_cache.ENTRY_OVERHEAD_BYTES if count_overhead else 0
    block_overhead = session_cache.BLOCK_OVERHEAD_BYTES if count_overhead else 0

    def fill(caches: SessionCaches, session: str) -> None:
        kv = caches.for_fill(session, 1, 0, 1, 1, 1)
        span(hidden, kv=kv)
        caches.filled(session, 1, kv, ok=True)

    with mock.patch.multiple(session_cache, ENTRY_OVERHEAD_BYTES=entry_overhead, BLOCK_OVERHEAD_BYTES=block_overhead), \
            torch.inference_mode():
        warm = SessionCaches(config, budget, ttl=600)
        for index in range(200):  # warm up the allocator and torch first
            fill(warm, f"warm-{index}")
        del warm
        caches = SessionCaches(config, budget, ttl=600, max_entries=10**6)
        gc.collect()
        before = malloc_held_bytes()
        for index in range(FILLS):
            fill(caches, f"session-{index:06d}")
        gc.collect()
        held = malloc_held_bytes() - before
        kept = len(caches.entries)
        assert caches.used_bytes <= budget and caches.stats.evictions == FILLS - kept
        assert caches.used_bytes == sum(entry.size for entry in caches.entries.values())
        if count_overhead:
            assert caches.cost_of(1, 1, 1) > caches.size_of(1, 1, 1)  # the overhead is counted, not just the tensors
    return {"kept": kept, "used_bytes": caches.used_bytes, "held": held, "budget": budget}
