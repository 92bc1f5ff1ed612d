"""Keys and values kept between denoising steps (Fast-dLLM prefix/dual cache, dKV-Cache).

A *fill* pass runs the whole sequence and remembers every block's keys and values (after RoPE). A
*reuse* pass runs only rows ``a:b`` of the sequence: their queries attend to the remembered keys and
values of every other position and to their own fresh ones. Positions outside ``a:b`` therefore see the
sequence as it was at the fill, which is the approximation the refresh period bounds.
"""
from __future__ import annotations

from typing import Optional

import torch


class CacheMiss(Exception):
    """A reuse pass found no usable cache (never filled, evicted, other shape): the caller must fill again."""


class BlockKV:
    """One block's keys and values (batch, kv_heads, length, head_dim) for one session."""

    def __init__(self) -> None:
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    def merge(self, keys: torch.Tensor, values: torch.Tensor,
              rows: Optional[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Remember everything (``rows`` None), or splice fresh rows ``a:b`` into the remembered ones."""
        if rows is None:
            self.keys, self.values = keys, values
            return keys, values
        if self.keys is None or self.values is None:
            raise CacheMiss("block was never filled")
        a, b = rows
        return (torch.cat([self.keys[:, :, :a], keys, self.keys[:, :, b:]], dim=2),
                torch.cat([self.values[:, :, :a], values, self.values[:, :, b:]], dim=2))


class SpanKV:
    """A session's cache over some blocks, filled by one full pass of ``batch`` rows of ``length`` positions."""

    def __init__(self, batch: int, length: int):
        self.batch, self.length = batch, length
        self.blocks: dict[int, BlockKV] = {}

    def block(self, index: int) -> BlockKV:
        return self.blocks.setdefault(index, BlockKV())

    def check_reuse(self, start: int, end: int, batch: int, rows: tuple[int, int]) -> None:
        """Raise :class:`CacheMiss` unless blocks ``start:end`` were filled for this batch and length."""
        missing = [i for i in range(start, end) if i not in self.blocks or self.blocks[i].keys is None]
        if missing:
            raise CacheMiss(f"blocks {missing[0]}..{missing[-1]} have no cached keys for this session")
        if batch != self.batch:
            raise CacheMiss(f"batch {batch} differs from the cached batch {self.batch}")
        if not 0 <= rows[0] < rows[1] <= self.length:
            raise CacheMiss(f"rows {rows[0]}:{rows[1]} are outside the cached length {self.length}")
