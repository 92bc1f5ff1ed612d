"""Keys and values kept between denoising steps (Fast-dLLM prefix/dual cache, dKV-Cache).

A *fill* pass runs the whole sequence and remembers every block's keys and values (after RoPE). A
*reuse* pass runs only rows ``a:b`` of the sequence: their queries attend to the remembered keys and
values of every other position and to their own fresh ones. Positions outside ``a:b`` therefore see the
sequence as it was at the fill, which is the approximation the refresh period bounds.
"""
from __future__ import annotations

from typing import Optional

import torch

from swarm.utils.errors import SwarmError


class CacheMiss(SwarmError):
    """A reuse pass found no usable cache (never filled, evicted, other shape): the caller must fill again."""


class BlockKV:
    """One block's keys and values (batch, kv_heads, length, head_dim) for one session: the tensors of its fill."""

    __slots__ = ("keys", "values")

    def __init__(self) -> None:
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    @property
    def filled(self) -> bool:
        return self.keys is not None

    def remember(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values

    def merge(self, keys: torch.Tensor, values: torch.Tensor,
              rows: Optional[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Remember everything (``rows`` None), or splice fresh rows ``a:b`` into the remembered ones."""
        if rows is None:
            self.remember(keys, values)
            return keys, values
        if not self.filled:
            raise CacheMiss("block was never filled")
        a, b = rows
        return (torch.cat([self.keys[:, :, :a], keys, self.keys[:, :, b:]], dim=2),
                torch.cat([self.values[:, :, :a], values, self.values[:, :, b:]], dim=2))


class SlotKV(BlockKV):
    """A block whose keys and values are copied into a slot of storage reserved before the fill ran.

    Views of the slot are made when read, so a block costs one small object beyond its bytes."""

    __slots__ = ("storage", "slot", "_filled")

    def __init__(self, storage: torch.Tensor, slot: int):
        self.storage, self.slot, self._filled = storage, slot, False

    @property
    def filled(self) -> bool:
        return self._filled

    @property
    def keys(self) -> Optional[torch.Tensor]:
        return self.storage[self.slot, 0] if self._filled else None

    @property
    def values(self) -> Optional[torch.Tensor]:
        return self.storage[self.slot, 1] if self._filled else None

    def remember(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.storage[self.slot, 0].copy_(keys)
        self.storage[self.slot, 1].copy_(values)
        self._filled = True


class SpanKV:
    """A session's cache over some blocks, filled by one full pass of ``batch`` rows of ``length`` positions.

    ``storage`` (blocks, 2, batch, kv_heads, length, head_dim), when given, is where the fill's keys and
    values go (see :meth:`reserve`); without it the cache keeps the tensors the fill computed.
    """

    __slots__ = ("batch", "length", "storage", "blocks", "source")

    def __init__(self, batch: int, length: int, storage: Optional[torch.Tensor] = None):
        self.batch, self.length = batch, length
        self.storage = storage
        self.blocks: dict[int, BlockKV] = {}
        self.source = b""  # the digest of the fill call that built it: a reuse's receipt names it

    @classmethod
    def reserve(cls, blocks: int, batch: int, length: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: str | torch.device = "cpu") -> "SpanKV":
        """A cache whose bytes are allocated now, in one piece: what a server counts is what it holds, and
        the piece returns to the system whole when the cache is dropped (no heap left fragmented by the
        fill's temporaries)."""
        return cls(batch, length, torch.empty(blocks, 2, batch, kv_heads, length, head_dim, dtype=dtype, device=device))

    def block(self, index: int) -> BlockKV:
        block = self.blocks.get(index)
        if block is None:
            if self.storage is None:
                block = BlockKV()
            elif len(self.blocks) < self.storage.shape[0]:
                block = SlotKV(self.storage, len(self.blocks))
            else:
                raise CacheMiss(f"block {index} is beyond the {self.storage.shape[0]} blocks reserved for this cache")
            self.blocks[index] = block
        return block

    def check_reuse(self, start: int, end: int, batch: int, rows: tuple[int, int]) -> None:
        """Raise :class:`CacheMiss` unless blocks ``start:end`` were filled for this batch and length."""
        missing = [i for i in range(start, end) if i not in self.blocks or not self.blocks[i].filled]
        if missing:
            raise CacheMiss(f"blocks {missing[0]}..{missing[-1]} have no cached keys for this session")
        if batch != self.batch:
            raise CacheMiss(f"batch {batch} differs from the cached batch {self.batch}")
        if not 0 <= rows[0] < rows[1] <= self.length:
            raise CacheMiss(f"rows {rows[0]}:{rows[1]} are outside the cached length {self.length}")
