"""Which of the models a process knows a swarm serves: so that a command joining a swarm without ``--model`` takes the
model the swarm's servers hold instead of a default that nobody serves (``swarm.improve``: issue 56)."""
from __future__ import annotations

from typing import Optional

from hivemind import DHT

from swarm.dht.schema import read_servers


def served_blocks(dht: DHT, models: dict[str, tuple[str, int]]) -> dict[str, set[int]]:
    """For each model ``name -> (DHT prefix, blocks)``, the blocks some announced server holds (empty: none)."""
    served: dict[str, set[int]] = {}
    for name, (prefix, num_blocks) in models.items():
        records = read_servers(dht, prefix, num_blocks).values()
        served[name] = {block for record in records for block in range(record.start, record.end)}
    return served


def choose_served(served: dict[str, set[int]], sizes: dict[str, int], preferred: str) -> Optional[str]:
    """The model to use: one whose every block is served (``preferred`` among several), else the one with the most
    blocks served; None when the swarm serves none of them."""
    complete = [name for name, blocks in served.items() if blocks and len(blocks) == sizes[name]]
    if complete:
        return preferred if preferred in complete else complete[0]
    partial = [name for name, blocks in served.items() if blocks]
    return max(partial, key=lambda name: len(served[name])) if partial else None
