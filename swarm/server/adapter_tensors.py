"""Per-block adapter tensors that clients sent, kept by content digest so that later calls can name them.

A client training or generating with a LoRA sends the same (blocks, R, hidden) tensor with every call of a step, and
with every denoising step of a generation: at LLaDA-8B's widths a rank-8 LoRA is 2.6 MB per block, as much as the
hidden states of a few hundred positions. A server keeps each tensor it received under the digest it computes itself
from the bytes (:meth:`swarm.adapters.block.BlockAdapter.digest`), and answers that it did (``prompt_held``); the
client's next call for the same tensor carries the digest alone.

Hostile clients: the digest is the server's own hash of what arrived, so nobody can file a tensor under another
one's digest. Entries are kept per peer (libp2p id): a peer finds only what it sent itself, so naming a digest
tells nobody whether another client uses that adapter (one who has the bytes could otherwise probe for it), and
uploading a victim's bytes makes a second entry of the uploader's own instead of taking the victim's over (which
the uploader's own flood would then evict). The same tensor sent by two clients is kept twice: privacy over
memory. Memory is bounded in bytes, least recently used first, and one peer may fill at most ``peer_share`` of it
(its own oldest tensors go first), so a flood evicts the flooder's entries before anyone else's. A tensor over a
peer's share is not kept: that client just sends it every time, as without this store. Nothing is lost to an
eviction: the client's next call misses (``adapter_miss``) and sends the tensor again. The counters are the
operator's (logs, ``Server.info``); the info RPC shows a caller only its own entries.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from swarm.adapters.block import BlockAdapter

ENTRY_OVERHEAD_BYTES = 512  # the entry's Python objects and its keys in the indexes


@dataclass
class AdapterTensorStats:
    stored: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    refused: int = 0  # tensors over a peer's share, not kept


@dataclass(slots=True)
class _Entry:
    adapter: BlockAdapter  # its kind is part of the digest: a name never means another kind
    size: int


Key = tuple[str, str]  # (peer, digest): each peer's uploads are its own


class AdapterTensors:
    """Tensors by (peer, digest), least recently used first, bounded in bytes overall and per peer."""

    def __init__(self, max_bytes: int, peer_share: float = 0.5):
        if max_bytes < 0 or not 0 < peer_share <= 1:
            raise ValueError(f"max_bytes must be >= 0 and peer_share in (0, 1], got {max_bytes} and {peer_share}")
        self.max_bytes = max_bytes
        self.max_peer_bytes = int(max_bytes * peer_share)
        self.entries: OrderedDict[Key, _Entry] = OrderedDict()
        self.bytes = 0
        self.peer_bytes: dict[str, int] = {}
        self.peer_hits: dict[str, int] = {}  # kept while the peer holds entries: what its info RPC shows
        self.stats = AdapterTensorStats()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def info(self, peer: Optional[str] = None) -> dict:
        """The bounds, with every counter (the operator's view) or, for ``peer``, only its own entries."""
        bounds = {"max_bytes": self.max_bytes, "max_peer_bytes": self.max_peer_bytes}
        if peer is None:
            return {**bounds, "entries": len(self.entries), "bytes": self.bytes, **dataclasses.asdict(self.stats)}
        own = sum(1 for owner, _ in self.entries if owner == peer)
        return {**bounds, "entries": own, "bytes": self.peer_bytes.get(peer, 0), "hits": self.peer_hits.get(peer, 0)}

    def get(self, digest: str, peer: str) -> Optional[BlockAdapter]:
        """The adapter ``peer`` filed under ``digest`` (now the most recently used), or None."""
        entry = self.entries.get((peer, digest))
        if entry is None:
            self.stats.misses += 1
            return None
        self.entries.move_to_end((peer, digest))
        self.stats.hits += 1
        self.peer_hits[peer] = self.peer_hits.get(peer, 0) + 1
        return entry.adapter

    def put(self, digest: str, adapter: BlockAdapter, peer: str) -> bool:
        """Keep ``adapter`` (which the caller hashed to ``digest``) as ``peer``'s upload; False when it is over the
        peer's share and was not kept."""
        weights = adapter.weights
        size = weights.numel() * weights.element_size() + ENTRY_OVERHEAD_BYTES
        if size > self.max_peer_bytes:
            self.stats.refused += 1
            return False
        self._drop((peer, digest))
        self._evict(lambda: self.peer_bytes.get(peer, 0) + size > self.max_peer_bytes, peer)
        self._evict(lambda: self.bytes + size > self.max_bytes)
        self.entries[peer, digest] = _Entry(adapter, size)
        self.bytes += size
        self.peer_bytes[peer] = self.peer_bytes.get(peer, 0) + size
        self.stats.stored += 1
        return True

    def _evict(self, over, peer: Optional[str] = None) -> None:
        """Drop the least recently used entries (only ``peer``'s when given) while ``over()``."""
        for key in [key for key in self.entries if peer is None or key[0] == peer]:
            if not over():
                return
            self._drop(key)
            self.stats.evictions += 1

    def _drop(self, key: Key) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        peer = key[0]
        self.bytes -= entry.size
        left = self.peer_bytes[peer] - entry.size
        if left:
            self.peer_bytes[peer] = left
        else:
            del self.peer_bytes[peer]
            self.peer_hits.pop(peer, None)
