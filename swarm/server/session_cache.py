"""Per-session keys and values on a server (the activation cache), bounded in bytes, in count and in idle time.

A session's cache comes in numbered versions, one per fill: a fill request builds version v (dropping the
session's versions older than its ``keep_from``), reuse requests read the version they name. Naming the
version lets a client keep calls in flight across a fill: a reuse that overtakes its fill on the network,
or arrives while the fill still runs, waits for it (briefly when the fill has not arrived at all, since
after a failover it never will). A version is counted at its real cost: the keys and values, reserved in
one piece when the fill starts, plus a measured overhead per version and per block, so a flood of tiny
fills cannot hold more memory than the budget says. When a new fill would not fit the budget (or the
count of versions), the least recently used versions are evicted; a fill larger than the whole budget is
computed without being kept (its reuses then miss, and the client falls back to uncached calls). Versions
idle for longer than the time-to-live are dropped on the next access to the store.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

from swarm.models.config import ModelConfig
from swarm.models.kv_cache import CacheMiss, SpanKV

logger = logging.getLogger(__name__)

ARRIVAL_WAIT_S = 1.0  # default wait of a reuse for a fill this server has not received yet
MAX_WAITING = 256  # reuses waiting for fills at once; more miss at once (a flood cannot pile up)
DEFAULT_MAX_ENTRIES = 4096  # cache versions kept at once, whatever their size
# What a version costs beyond its keys and values: its Python objects (entry, SpanKV, storage tensor, keys of
# the indexes) and those of each block it holds, measured by benchmarks/server_bounds.py and rounded up.
ENTRY_OVERHEAD_BYTES = 2048
BLOCK_OVERHEAD_BYTES = 256

CacheKey = tuple[str, int]  # (session id, version)


@dataclass
class CacheStats:
    fills: int = 0
    reuses: int = 0
    misses: int = 0
    evictions: int = 0
    refused: int = 0  # fills too large for the whole budget, computed without being kept
    waits: int = 0  # reuses that arrived before their fill had run


@dataclass(slots=True)
class CacheEntry:
    kv: SpanKV
    size: int  # bytes counted for it: its keys and values, reserved when the fill started, and its overhead
    used: float  # last access, time.monotonic()
    ready: bool = False  # the fill pass has run


class SessionCaches:
    """The versions of every session, least recently used first, with their bytes and count bounded.

    Every operation costs O(1) amortised, or O(versions of one session): the byte total is kept as entries
    come and go, each session's versions are indexed, and expiry pops from the least recently used end.
    ``dtype`` and ``device`` are those of the span's compute.
    """

    def __init__(self, config: ModelConfig, budget_bytes: int, ttl: float, fill_timeout: float = 30.0,
                 arrival_wait: float = ARRIVAL_WAIT_S, *, max_entries: int = DEFAULT_MAX_ENTRIES,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.config, self.budget_bytes, self.ttl = config, budget_bytes, ttl
        self.dtype = dtype
        self.element_size = torch.empty(0, dtype=dtype).element_size()
        self.device = device
        self.max_entries = max_entries
        self.fill_timeout = fill_timeout  # how long a reuse waits for a fill that is running here
        self.arrival_wait = arrival_wait  # ... and for one not received (after a failover it never comes)
        self.entries: OrderedDict[CacheKey, CacheEntry] = OrderedDict()  # least recently used first
        self.versions: dict[str, set[int]] = {}  # each session's versions in ``entries``
        self.used_bytes = 0  # sum of the entries' sizes
        self.arrivals: dict[CacheKey, asyncio.Event] = {}  # set when that fill has run (or failed)
        self.stats = CacheStats()

    @property
    def sessions(self) -> set[str]:
        return set(self.versions)

    def size_of(self, blocks: int, batch: int, length: int) -> int:
        """Bytes of keys and values for ``blocks`` blocks: reserved before the fill runs."""
        cfg = self.config
        return 2 * blocks * batch * cfg.num_kv_heads * length * cfg.head_dim * self.element_size

    def cost_of(self, blocks: int, batch: int, length: int) -> int:
        """What a version is counted at: its keys and values and its measured overhead."""
        return self.size_of(blocks, batch, length) + ENTRY_OVERHEAD_BYTES + blocks * BLOCK_OVERHEAD_BYTES

    def tokens_left(self, blocks: int) -> int:
        """How many more positions of one sequence through ``blocks`` blocks fit without evicting anyone: what the
        server announces as ``cache_tokens_left`` (the map's cache column), so that its free room is visible.

        Only reads counters (the announcement runs in a worker thread); versions past their TTL still count until
        the next access drops them."""
        free = self.budget_bytes - self.used_bytes - self.cost_of(blocks, 1, 0)
        return max(0, free // self.size_of(blocks, 1, 1))

    def for_fill(self, session_id: str, version: int, keep_from: int, blocks: int, batch: int,
                 length: int) -> Optional[SpanKV]:
        """A fresh cache for version ``version`` of the session, or None when it can never fit.

        Call :meth:`filled` once the fill pass has run (or failed)."""
        self.expire()
        for old in [v for v in self.versions.get(session_id, ()) if v < keep_from or v == version]:
            self._drop((session_id, old))
        size = self.cost_of(blocks, batch, length)
        if size > self.budget_bytes:
            self.stats.refused += 1
            logger.warning("session %s needs %d bytes of cache, over the whole budget of %d: not kept",
                           session_id[:8], size, self.budget_bytes)
            self._wake((session_id, version))
            return None
        while self.entries and (self.used_bytes + size > self.budget_bytes or len(self.entries) >= self.max_entries):
            self._pop_oldest()
        cfg = self.config
        kv = SpanKV.reserve(blocks, batch, length, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        self._add((session_id, version), CacheEntry(kv, size, time.monotonic()))
        self.stats.fills += 1
        return kv

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
                self._drop(key)
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
        """Drop the versions idle for longer than the TTL: they come first in ``entries``."""
        cutoff = time.monotonic() - self.ttl
        while self.entries and next(iter(self.entries.values())).used < cutoff:
            self._pop_oldest()

    # ----- the indexes -----------------------------------------------------------------------------
    def _add(self, key: CacheKey, entry: CacheEntry) -> None:
        self.entries[key] = entry
        self.versions.setdefault(key[0], set()).add(key[1])
        self.used_bytes += entry.size

    def _drop(self, key: CacheKey) -> None:
        """Forget a version (a request still computing with it keeps its memory until it ends)."""
        self._unindex(key, self.entries.pop(key))

    def _pop_oldest(self) -> None:
        key, entry = self.entries.popitem(last=False)
        self._unindex(key, entry)
        self.stats.evictions += 1
        logger.debug("evicted cache version %d of session %s", key[1], key[0][:8])

    def _unindex(self, key: CacheKey, entry: CacheEntry) -> None:
        self.used_bytes -= entry.size
        versions = self.versions[key[0]]
        versions.discard(key[1])
        if not versions:
            del self.versions[key[0]]

    def info(self) -> dict:
        return {"sessions": len(self.versions), "versions": len(self.entries), "used_bytes": self.used_bytes,
                "budget_bytes": self.budget_bytes, "max_versions": self.max_entries, "ttl_s": self.ttl,
                **vars(self.stats)}
