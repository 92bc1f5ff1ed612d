"""Per-session keys and values on a server (the activation cache), bounded in bytes and in idle time.

A fill request replaces the session's cache; reuse requests read it. When a new fill would not fit the
budget, the least recently used sessions are evicted; a fill larger than the whole budget is computed
without being kept (its reuses then miss, and the client falls back to uncached calls). Sessions idle
for longer than the time-to-live are dropped on the next access to the store.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from swarm.models.config import ModelConfig
from swarm.models.kv_cache import CacheMiss, SpanKV

logger = logging.getLogger(__name__)


@dataclass
class CacheStats:
    fills: int = 0
    reuses: int = 0
    misses: int = 0
    evictions: int = 0
    refused: int = 0  # fills too large for the whole budget, computed without being kept


class SessionCaches:
    def __init__(self, config: ModelConfig, budget_bytes: int, ttl: float, element_size: int):
        self.config, self.budget_bytes, self.ttl, self.element_size = config, budget_bytes, ttl, element_size
        self.sessions: OrderedDict[str, tuple[SpanKV, int, float]] = OrderedDict()  # kv, reserved bytes, last use
        self.stats = CacheStats()

    @property
    def used_bytes(self) -> int:
        return sum(reserved for _, reserved, _ in self.sessions.values())

    def size_of(self, blocks: int, batch: int, length: int) -> int:
        """Bytes of keys and values for ``blocks`` blocks: reserved before the fill runs."""
        cfg = self.config
        return 2 * blocks * batch * cfg.num_kv_heads * length * cfg.head_dim * self.element_size

    def for_fill(self, session_id: str, blocks: int, batch: int, length: int) -> Optional[SpanKV]:
        """A fresh cache for the session (replacing its old one), or None when it can never fit."""
        self.expire()
        self.sessions.pop(session_id, None)
        size = self.size_of(blocks, batch, length)
        if size > self.budget_bytes:
            self.stats.refused += 1
            logger.warning("session %s needs %d bytes of cache, over the whole budget of %d: not kept",
                           session_id[:8], size, self.budget_bytes)
            return None
        while self.used_bytes + size > self.budget_bytes:
            evicted, _ = self.sessions.popitem(last=False)
            self.stats.evictions += 1
            logger.info("evicted the cache of session %s (budget %d bytes)", evicted[:8], self.budget_bytes)
        kv = SpanKV(batch, length)
        self.sessions[session_id] = (kv, size, time.monotonic())
        self.stats.fills += 1
        return kv

    def for_reuse(self, session_id: str) -> SpanKV:
        self.expire()
        entry = self.sessions.get(session_id)
        if entry is None:
            self.stats.misses += 1
            raise CacheMiss(f"no cache for session {session_id[:8]} on this server")
        kv, size, _ = entry
        self.sessions[session_id] = (kv, size, time.monotonic())
        self.sessions.move_to_end(session_id)
        self.stats.reuses += 1
        return kv

    def expire(self) -> None:
        cutoff = time.monotonic() - self.ttl
        for session_id in [s for s, (_, _, used) in self.sessions.items() if used < cutoff]:
            del self.sessions[session_id]
            self.stats.evictions += 1

    def info(self) -> dict:
        return {"sessions": len(self.sessions), "used_bytes": self.used_bytes, "budget_bytes": self.budget_bytes,
                "ttl_s": self.ttl, **vars(self.stats)}
