"""LoRA of every projection of a block, packed as one per-block adapter tensor (the ``lora`` kind).

Per-block adapters travel with each request as one ``(blocks, R, hidden)`` tensor, the slice of the hop's blocks
(deep prompts and bottlenecks use the same wire format, validation and backward). A LoRA is many small matrices of
different widths, so each block's row of that tensor holds them flattened: for each projection in
:data:`LORA_TARGETS` order its ``down`` (r, in) then its ``up`` (out, r), zero-padded to whole rows of ``hidden``.
The rank follows from R (:meth:`BlockWidths.rank`), so a request needs no more metadata than a bottleneck's.

Why every projection and not only attention: on the default backbone training every weight learns held-out
addition in 192k samples, where a bottleneck (rows only) stays near chance at 512k (docs/TRAINING.md).
A projection computes ``linear(x) + (x @ down.T) @ up.T`` in float32 (:func:`swarm.models.layers.project`); ``up``
starts at zero, so a new adapter is the identity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from swarm.models.layers import BlockLoRA

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class BlockWidths:
    """The widths a block's projections map between: all a LoRA's layout depends on."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    @classmethod
    def of(cls, config: Any) -> "BlockWidths":
        """From a :class:`~swarm.models.config.ModelConfig`, or an adapter's ``base`` dict of the same fields."""
        get = config.get if isinstance(config, dict) else lambda name: getattr(config, name)
        return cls(*(int(get(name)) for name in ("hidden_size", "num_heads", "num_kv_heads", "intermediate_size")))

    def projections(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of each target, in packing order."""
        d, i = self.hidden_size, self.intermediate_size
        kv = self.num_kv_heads * (d // self.num_heads)
        widths = {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d),
                  "gate_proj": (d, i), "up_proj": (d, i), "down_proj": (i, d)}
        return [(name, *widths[name]) for name in LORA_TARGETS]

    def floats_per_rank(self) -> int:
        return sum(width_in + width_out for _, width_in, width_out in self.projections())

    def rows(self, rank: int) -> int:
        """Rows of ``hidden_size`` one block's LoRA of ``rank`` takes in the adapter tensor."""
        return math.ceil(rank * self.floats_per_rank() / self.hidden_size)

    def rank(self, rows: int) -> Optional[int]:
        """The rank whose packed LoRA takes exactly ``rows`` rows, or None when no rank does."""
        rank = rows * self.hidden_size // self.floats_per_rank()
        return rank if rank >= 1 and self.rows(rank) == rows else None


def unpack_lora(weights: torch.Tensor, widths: BlockWidths) -> BlockLoRA:
    """One block's (R, hidden) slice as its projections' (down, up) pairs (views, so gradients reach ``weights``)."""
    rank = widths.rank(weights.shape[0])
    if rank is None:
        raise ValueError(f"{weights.shape[0]} rows hold no whole LoRA of this block's widths")
    flat, offset, pairs = weights.reshape(-1), 0, {}
    for name, width_in, width_out in widths.projections():
        down = flat[offset:offset + rank * width_in].view(rank, width_in)
        offset += rank * width_in
        up = flat[offset:offset + width_out * rank].view(width_out, rank)
        offset += width_out * rank
        pairs[name] = (down, up)
    return pairs


def new_lora_weights(widths: BlockWidths, rank: int, blocks: int, generator: torch.Generator) -> torch.Tensor:
    """(blocks, R, hidden): every ``down`` random with unit-scale outputs, every ``up`` zero (the identity)."""
    weights = torch.zeros(blocks, widths.rows(rank), widths.hidden_size)
    for block in range(blocks):
        for down, up in unpack_lora(weights[block], widths).values():
            down.copy_(torch.randn(down.shape, generator=generator) / math.sqrt(down.shape[1]))
    return weights

