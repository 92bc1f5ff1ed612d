"""Streams over subsets of the swarm: which domain stream each trainer node works for (docs/TRAINING.md, "Streams").

Several domains improve at once, each on its own pool of nodes, and a pool's size follows its stream's weight: the
nodes are shared out by the largest-remainder method over the weights, every live stream gets at least one node (a
trivial stream runs on a single node), and a stream whose audited curve has not risen in ``patience`` rounds has
stalled and gives its nodes back. Assignments move as few nodes as they can (a node stays in its stream while that
stream's pool still has room), and a stream's claim to nodes is checked against the work they did for it.

Plain data and arithmetic: no torch, no network; ``swarm.improve.stream_records`` carries streams over the DHT.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from swarm.utils.errors import SwarmError

MAX_STREAMS = 64


class ClaimError(SwarmError, ValueError):
    """A stream claims nodes it was not given or that did no work for it."""


@dataclass(frozen=True)
class Stream:
    name: str
    weight: float  # importance or difficulty: a pool's share of the nodes
    curve: tuple[float, ...] = ()  # the audited score of the stream's best version, round by round

    def stalled(self, patience: int, min_gain: float = 0.0) -> bool:
        """No audited gain above ``min_gain`` in the last ``patience`` rounds (a stream younger than that is live)."""
        if patience < 1 or len(self.curve) <= patience:
            return False
        return max(self.curve[-patience:]) <= max(self.curve[:-patience]) + min_gain


def live(streams: Sequence[Stream], patience: int, min_gain: float = 0.0) -> list[Stream]:
    """The streams that get nodes: a positive, finite weight and not stalled."""
    if len(streams) > MAX_STREAMS or len({s.name for s in streams}) != len(streams):
        raise ValueError(f"at most {MAX_STREAMS} streams, each name once")
    return [s for s in streams if math.isfinite(s.weight) and s.weight > 0 and not s.stalled(patience, min_gain)]


def pool_sizes(streams: Sequence[Stream], nodes: int, patience: int = 3, min_gain: float = 0.0) -> dict[str, int]:
    """How many of ``nodes`` each stream gets: the largest-remainder share of its weight, at least one per live stream
    (taken from the largest pool), none for a stalled one. With fewer nodes than live streams the heaviest get one."""
    active = sorted(live(streams, patience, min_gain), key=lambda s: (-s.weight, s.name))
    sizes = {s.name: 0 for s in streams}
    if nodes <= 0 or not active:
        return sizes
    if nodes <= len(active):
        for stream in active[:nodes]:
            sizes[stream.name] = 1
        return sizes
    total = sum(s.weight for s in active)
    quotas = {s.name: nodes * s.weight / total for s in active}
    for name, quota in quotas.items():
        sizes[name] = math.floor(quota)
    left = nodes - sum(sizes.values())
    for stream in sorted(active, key=lambda s: (-(quotas[s.name] - sizes[s.name]), -s.weight, s.name))[:left]:
        sizes[stream.name] += 1
    for stream in active:  # a trivial stream still runs on one node: the largest pool gives it
        if sizes[stream.name] == 0:
            donor = max(sizes, key=lambda name: (sizes[name], name))
            sizes[donor] -= 1
            sizes[stream.name] = 1
    return sizes


def assign(streams: Sequence[Stream], nodes: Sequence[str], previous: Optional[Mapping[str, str]] = None,
           patience: int = 3, min_gain: float = 0.0) -> dict[str, str]:
    """Node -> stream for every node that gets one: pools of :func:`pool_sizes`, each node staying in its previous
    stream while that pool has room (the fewest moves), the others filling the pools with room in node order."""
    sizes = pool_sizes(streams, len(nodes), patience, min_gain)
    previous = previous or {}
    result: dict[str, str] = {}
    room = dict(sizes)
    for node in sorted(nodes):
        stream = previous.get(node)
        if stream is not None and room.get(stream, 0) > 0:
            result[node] = stream
            room[stream] -= 1
    waiting = [node for node in sorted(nodes) if node not in result]
    for stream in sorted(room, key=lambda name: (-sizes[name], name)):
        while room[stream] > 0 and waiting:
            result[waiting.pop(0)] = stream
            room[stream] -= 1
    return result


def check_claim(stream: str, claimed: Sequence[str], assignment: Mapping[str, str],
                worked: Mapping[str, int], min_work: int = 1) -> None:
    """ClaimError unless every node ``stream`` claims was assigned to it and did at least ``min_work`` units of work
    for it (say, optimizer steps in its run since the last assignment): a stream cannot hold nodes it does not use."""
    foreign = sorted(node for node in claimed if assignment.get(node) != stream)
    if foreign:
        raise ClaimError(f"stream {stream!r} claims {len(foreign)} node(s) not in its pool: {', '.join(foreign[:3])}")
    idle = sorted(node for node in claimed if worked.get(node, 0) < min_work)
    if idle:
        raise ClaimError(f"stream {stream!r} claims {len(idle)} node(s) that did no work for it: "
                         f"{', '.join(idle[:3])}; they go back to the other streams")


def report(streams: Sequence[Stream], assignment: Mapping[str, str], patience: int = 3) -> list[dict]:
    """The streams as ``swarm.health --json`` would show them: weight, pool, curve, whether stalled."""
    return [{"stream": s.name, "weight": s.weight, "pool": sorted(n for n, t in assignment.items() if t == s.name),
             "curve": list(s.curve), "stalled": s.stalled(patience)} for s in streams]
