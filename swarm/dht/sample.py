"""Reading a shared list that anyone may write to: the reader's trust first, then a fair sample, never the writers'
order.

A shared DHT list (the authors of a prefix's adapters and the names each lists, the publishers of a name) is bounded,
and anyone with a free key may write to it. A reader that keeps "the first N" in an order the writers choose (names
that sort first, the entries that came first) lets one writer decide what everybody reads: one index entry listing 64
names that sort first emptied the catalog (issue 55). So a reader takes the entries of writers it trusts first, then
goes round the other writers in a random order, one random entry of each per round: a writer listing many entries gets
no more than one listing few, and no writer can know in advance which of its entries are read.
"""
from __future__ import annotations

import random
from typing import Hashable, Iterable, Mapping, Optional, Sequence, TypeVar

Item = TypeVar("Item", bound=Hashable)


def fair_sample(groups: Mapping[str, Sequence[Item]], limit: int, trusted: Iterable[str] = (),
                rng: Optional[random.Random] = None) -> list[tuple[str, Item]]:
    """At most ``limit`` (writer, item) pairs of ``groups`` ({writer: its items}), each item once: every item of the
    ``trusted`` writers first (in their order), then the others' round robin, writers and items in random order."""
    rng = rng or random.SystemRandom()
    trusted = [writer for writer in dict.fromkeys(trusted) if writer in groups]
    chosen: list[tuple[str, Item]] = []
    seen: set[Item] = set()

    def take(writer: str, item: Item) -> None:
        if item not in seen and len(chosen) < limit:
            seen.add(item)
            chosen.append((writer, item))

    for writer in trusted:
        for item in groups[writer]:
            take(writer, item)
    others = [writer for writer in groups if writer not in trusted]
    rng.shuffle(others)
    queues = {writer: rng.sample(list(groups[writer]), len(groups[writer])) for writer in others}
    while len(chosen) < limit and any(queues.values()):
        for writer in others:
            if queues[writer]:
                take(writer, queues[writer].pop())
    return chosen
