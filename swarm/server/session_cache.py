"""Per-session keys and values on a server (the activation cache), bounded in bytes and in idle time.

A session's cache comes in numbered versions, one per fill: a fill request builds version v (dropping the
session's versions older than its ``keep_from``), reuse requests read the version they name. Naming the
version lets a client keep calls in flight across a fill: a reuse that overtakes its fill on the network,
or arrives while the fill still runs, waits for it (briefly when the fill has not arrived at all, since
after a failover it never will). When a new fill would not fit the budget, the least recently used
versions are evicted; a fill larger than the whole budget is computed without being kept (its reuses then
miss, and the client falls back to uncached calls). Versions idle for longer than the time-to-live are
dropped on the next access to the store.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from swarm.models.config import ModelConfig
from swarm.models.kv_cache import CacheMiss, SpanKV

logger = logging.getLogger(__name__)

ARRIVAL_WAIT_S = 1.0  # default wait of a reuse for a fill this server has not received yet
MAX_WAITING = 256  # reuses waiting for fills at once; more miss at once (a flood cannot pile up)

CacheKey = tuple[str, int]  # (session id, version)


@dataclass
class CacheStats:
    fills: int = 0
    reuses: int = 0
    misses: int = 0
    evictions: int = 0
    refused: int = 0  # fills too large for the whole budget, computed without being kept
    waits: int = 0  # reuses that arrived before their fill had run


@dataclass
class CacheEntry:
    kv: SpanKV
    size: int  # bytes reserved when the fill started
    used: float  # last access, time.monotonic()
    ready: bool = False  # the fill pass has run


class SessionCaches:
    def __init__(self, config: ModelConfig, budget_bytes: int, ttl: float, element_size: int,
                 fill_timeout: float = 30.0, arrival_wait: float = ARRIVAL_WAIT_S):
        self.config, self.budget_bytes, self.ttl, self.element_size = config, budget_bytes, ttl, element_size
        self.fill_timeout = fill_timeout  # how long a reuse waits for a fill that is running here
        self.arrival_wait = arrival_wait  # ... and for one not received (after a failover it never comes)
        self.entries: OrderedDict[CacheKey, CacheEntry] = OrderedDict()  # least recently used first
        self.arrivals: dict[CacheKey, asyncio.Event] = {}  # set when that fill has run (or failed)
        self.stats = CacheStats()

    @property
    def used_bytes(self) -> int:
        return sum(entry.size for entry in self.entries.values())

    @property
    def sessions(self) -> set[str]:
        return {session for session, _ in self.entries}

    def size_of(self, blocks: int, batch: int, length: int) -> int:
        """Bytes of keys and values for ``blocks`` blocks: reserved before the fill runs."""
        cfg = self.config
        return 2 * blocks * batch * cfg.num_kv_heads * length * cfg.head_dim * self.element_size

    def for_fill(self, session_id: str, version: int, keep_from: int, blocks: int, batch: int,
                 length: int) -> Optional[SpanKV]:
        """A fresh cache for version ``version`` of the session, or None when it can never fit.

        Call :meth:`filled` once the fill pass has run (or failed)."""
        self.expire()
        for key in [k for k in self.entries if k[0] == session_id and (k[1] < keep_from or k[1] == version)]:
            del self.entries[key]
        size = self.size_of(blocks, batch, length)
        if size > self.budget_bytes:
            self.stats.refused += 1
            logger.warning("session %s needs %d bytes of cache, over the whole budget of %d: not kept",
                           session_id[:8], size, self.budget_bytes)
            self._wake((session_id, version))
            return None
        while self.used_bytes + size > self.budget_bytes:
            (evicted, evicted_version), _ = self.entries.popitem(last=False)
            self.stats.evictions += 1
            logger.info("evicted cache version %d of session %s (budget %d bytes)", evicted_version, evicted[:8],
                        self.budget_bytes)
        entry = CacheEntry(SpanKV(batch, length), size, time.monotonic())
        self.entries[session_id, version] = entry
        self.stats.fills += 1
        return entry.kv

    def filled(self, session_id: str, version: int, kv: Optional[SpanKV], ok: bool) -> None:
        """The fill pass of this version (into ``kv``) has run: its reuses may go on (or, when it failed, miss)."""
        key = (session_id, version)
        entry = self.entries.get(key)
        if entry is not None and entry.kv is not kv:
            return  # a repeated fill of this version started since: its own pass will tell
        if entry is not None:
            if ok:
                entry.ready = True
            else:
                del self.entries[key]
        self._wake(key)

    async def for_reuse(self, session_id: str, version: int) -> SpanKV:
        """The session's cache version ``version``, once its fill has run; :class:`CacheMiss` if there is none."""
        self.expire()
        key = (session_id, version)
        entry = self.entries.get(key)
        if entry is None:  # the fill may still be on its way
            await self._wait(key, self.arrival_wait)
            entry = self.entries.get(key)
        if entry is not None and not entry.ready:  # the fill is running here
            await self._wait(key, self.fill_timeout)
            entry = self.entries.get(key)
        if entry is None or not entry.ready:
            self.stats.misses += 1
            raise CacheMiss(f"no cache version {version} for session {session_id[:8]} on this server")
        entry.used = time.monotonic()
        self.entries.move_to_end(key)
        self.stats.reuses += 1
        return entry.kv

    async def _wait(self, key: CacheKey, timeout: float) -> None:
        if len(self.arrivals) >= MAX_WAITING and key not in self.arrivals:
            return
        self.stats.waits += 1
        event = self.arrivals.setdefault(key, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            if key not in self.entries and self.arrivals.get(key) is event:
                del self.arrivals[key]  # no fill is coming: forget it (other waiters time out by themselves)

    def _wake(self, key: CacheKey) -> None:
        event = self.arrivals.pop(key, None)
        if event is not None:
            event.set()

    def expire(self) -> None:
        cutoff = time.monotonic() - self.ttl
        for key in [k for k, entry in self.entries.items() if entry.used < cutoff]:
            del self.entries[key]
            self.stats.evictions += 1

    def info(self) -> dict:
        return {"sessions": len(self.sessions), "versions": len(self.entries), "used_bytes": self.used_bytes,
                "budget_bytes": self.budget_bytes, "ttl_s": self.ttl, **vars(self.stats)}
