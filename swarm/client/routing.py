"""Choosing a chain of servers that covers every block with the least expected latency."""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Mapping, Optional

from swarm.dht.schema import ServerRecord, ServerState
from swarm.utils.errors import EXIT_NOT_SERVED, SwarmError


@dataclass(frozen=True)
class RouteHop:
    peer_id: str
    start: int
    end: int

    def __str__(self) -> str:
        return f"{self.peer_id[-8:]}[{self.start}:{self.end}]"


class MissingBlocksError(SwarmError, RuntimeError):
    """No usable server covers some blocks; the message names them."""

    exit_code = EXIT_NOT_SERVED

    def __init__(self, blocks: list[int], tried: Optional[list[str]] = None, requirement: str = ""):
        self.blocks = blocks
        ranges = compress_ranges(blocks)
        tried_text = f"; tried: {'; '.join(tried)}" if tried else ""
        that = f" that {requirement}" if requirement else ""
        super().__init__(f"no online server{that} holds blocks {ranges}{tried_text}")


def compress_ranges(blocks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0:3, 5:6' (end exclusive, like --blocks)."""
    out, start, previous = [], None, None
    for block in sorted(blocks):
        if start is None:
            start = previous = block
        elif block == previous + 1:
            previous = block
        else:
            out.append(f"{start}:{previous + 1}")
            start = previous = block
    if start is not None:
        out.append(f"{start}:{previous + 1}")
    return ", ".join(out)


def hop_cost(record: ServerRecord, blocks: int, latency: float, tokens: int) -> float:
    compute = tokens * blocks / max(record.end - record.start, 1) / max(record.throughput, 1e-3)
    return latency + compute


def find_route(
    servers: Mapping[str, ServerRecord],
    num_blocks: int,
    start_block: int = 0,
    latencies: Optional[Mapping[str, float]] = None,
    banned: frozenset[str] = frozenset(),
    tokens: int = 128,
    default_latency: float = 0.1,
    finishers: Optional[frozenset[str]] = None,
) -> list[RouteHop]:
    """Dijkstra over block boundaries: a server holding ``s:e`` offers an edge ``b -> e`` for ``s <= b < e``.

    Edge cost is its round trip plus estimated compute; ties go to the lower peer id, so routes are stable.
    With ``finishers`` only those peers may serve the hop that ends at the last block (the head servers).
    """
    latencies = latencies or {}
    usable = {pid: r for pid, r in servers.items() if r.state == ServerState.ONLINE and pid not in banned}
    missing = [b for b in range(start_block, num_blocks) if not any(r.start <= b < r.end for r in usable.values())]
    if finishers is not None and not any(p in finishers and r.end >= num_blocks for p, r in usable.items()):
        missing = sorted(set(missing) | {num_blocks - 1})
    if missing:
        raise MissingBlocksError(missing, sorted(p[-8:] for p in banned) or None)
    best: dict[int, float] = {start_block: 0.0}
    previous: dict[int, tuple[int, RouteHop]] = {}
    queue = [(0.0, start_block)]
    while queue:
        cost, block = heapq.heappop(queue)
        if block == num_blocks:
            break
        if cost > best.get(block, float("inf")):
            continue
        for peer_id in sorted(usable):
            record = usable[peer_id]
            if not record.start <= block < record.end:
                continue
            end = min(record.end, num_blocks)
            if end == num_blocks and finishers is not None and peer_id not in finishers:
                continue
            total = cost + hop_cost(record, end - block, latencies.get(peer_id, default_latency), tokens)
            if total < best.get(end, float("inf")):
                best[end] = total
                previous[end] = (block, RouteHop(peer_id, block, end))
                heapq.heappush(queue, (total, end))
    if num_blocks not in previous and start_block != num_blocks:  # the finishers start after every way in
        raise MissingBlocksError([num_blocks - 1], None)
    route, block = [], num_blocks
    while block != start_block:
        block, hop = previous[block]
        route.append(hop)
    return route[::-1]
