"""Choosing which blocks a new server should host: the least-covered span (Petals-style)."""
from __future__ import annotations

from typing import Iterable, Sequence

from swarm.dht.schema import ServerRecord, ServerState


def coverage(servers: Iterable[ServerRecord], num_blocks: int) -> list[float]:
    """Per block, the summed throughput of the servers that are online or joining for it."""
    cover = [0.0] * num_blocks
    for record in servers:
        if record.state == ServerState.OFFLINE:
            continue
        for block in range(record.start, min(record.end, num_blocks)):
            cover[block] += max(record.throughput, 1.0)
    return cover


def choose_span(servers: Iterable[ServerRecord], num_blocks: int, span_length: int) -> tuple[int, int]:
    """The window of ``span_length`` blocks whose weakest block is least served (then leftmost)."""
    if not 1 <= span_length <= num_blocks:
        raise ValueError(f"span length {span_length} must be between 1 and {num_blocks}")
    best = least_covered_window(coverage(servers, num_blocks), span_length)
    return best, best + span_length


def least_covered_window(cover: Sequence[float], span_length: int) -> int:
    """The first block of the window of ``span_length`` blocks whose weakest block is least served (then the least
    served in all, then leftmost): the built-in rule, also the baseline the ``host-blocks`` domain scores."""
    return min(range(len(cover) - span_length + 1),
               key=lambda s: (min(cover[s:s + span_length]), sum(cover[s:s + span_length]), s))
