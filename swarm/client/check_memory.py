"""How much of the model a client may load to check hops itself (``ClientConfig.spot_check_memory_mb``).

A client checks a hop itself in two ways (``swarm.client.spot_check``): it recomputes a hop no other server holds
on its own checkpoint (:class:`~swarm.client.reference.LocalReference`), and it scores a replica's hidden states with
its own head to check a head server. Both load weights the client otherwise never holds: at LLaDA-8B's widths one
block is 416 MiB and the head 988 MiB, against the client's own 0.4 GB, and a checkpoint named by repo id would
download them first. So a check that would load more than the bound leaves its hop unchecked instead (reported as
any unchecked hop, with the reason), unless the request accepts only verified results (the ``restricted`` tier),
which loads what its checks need rather than return tokens nobody checked.
"""
from __future__ import annotations

import threading
from typing import Callable

MiB = 2**20


class CheckMemory:
    """The bytes of weights checks may load in this client, and those they have loaded (counted before loading,
    from the parts' shapes, so a refused check reads nothing)."""

    def __init__(self, limit_mb: float, span_bytes: Callable[[int, int], int], head_bytes: Callable[[], int],
                 head_held: Callable[[], bool]):
        self.limit = int(limit_mb * MiB)
        self.span_bytes, self.head_bytes, self.head_held = span_bytes, head_bytes, head_held
        self.loaded = 0  # bytes of weights loaded for checks so far
        self._lock = threading.Lock()  # calls in flight (stale pipelining) may check at once

    def cost(self, blocks: tuple[int, int] | None, head: bool) -> int:
        """Bytes a check would load: ``blocks`` (None: none) and, with ``head``, the head unless it is held."""
        return ((self.span_bytes(*blocks) if blocks is not None else 0)
                + (self.head_bytes() if head and not self.head_held() else 0))

    def take(self, blocks: tuple[int, int] | None, head: bool, what: str) -> str | None:
        """Count a check's load against the bound and return None, or (over it) why the check cannot load it."""
        with self._lock:
            cost = self.cost(blocks, head)
            if self.loaded + cost <= self.limit:
                self.loaded += cost
                return None
        return (f"{what} would load {cost / MiB:,.0f} MiB of weights into this client, over "
                f"ClientConfig.spot_check_memory_mb ({self.limit / MiB:,.0f} MiB, {self.loaded / MiB:,.0f} loaded)")
