"""A per-block adapter as one value: its kind and its ``(blocks, R, hidden)`` weights, and the maths of each block.

:class:`BlockAdapter` is what travels with a request (the slice of the hop's blocks), what a server checks, keeps
by digest and applies, and what the local model applies: one function per kind, so the tokens of the local model
and of the swarm agree. Block i's slice acts at block i:

* ``deep_prompt``: ``R`` vectors added to the states of the absolute positions 0:R before the block
  (:func:`add_prompt`);
* ``bottleneck``: a residual MLP of rank ``R / 2`` applied to every row before the block (:func:`add_bottleneck`);
* ``lora``: low-rank corrections of every projection inside the block, packed into ``R`` rows
  (:mod:`swarm.adapters.lora`).

This module sits below the wire (requests carry the value) and above the model: a span takes any object with
:meth:`BlockAdapter.check` and :meth:`BlockAdapter.enter` (:class:`swarm.models.modules.SpanAdapter`).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from hivemind.utils import MSGPackSerializer

from swarm.adapters.kinds import BOTTLENECK, DEEP_PROMPT, LORA, PER_BLOCK_KINDS
from swarm.adapters.lora import BlockWidths, unpack_lora
from swarm.models.layers import BlockLoRA

DIGEST_DOMAIN = "swarm-adapter-tensor-v1"  # hashed first: a digest names nothing but an adapter tensor
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def is_sha256_hex(value: Any) -> bool:
    """A SHA-256 as 64 lowercase hex digits: how adapter tensors and adapter files are named on the wire."""
    return isinstance(value, str) and SHA256_HEX.fullmatch(value) is not None


def check_rows(kind: str, rows: int, widths: BlockWidths) -> None:
    """A per-block adapter tensor of ``rows`` rows per block must be of a known kind (a bottleneck's rows are its
    down and up projections, so an even number; a LoRA's, its packed projections of some rank). ValueError if
    not."""
    if kind not in PER_BLOCK_KINDS:
        raise ValueError(f"unknown per-block adapter kind {kind!r}; known: {', '.join(PER_BLOCK_KINDS)}")
    if kind == BOTTLENECK and rows % 2:
        raise ValueError(f"a bottleneck adapter's tensor holds 2 x rank rows per block, got {rows}")
    if kind == LORA and widths.rank(rows) is None:
        raise ValueError(f"{rows} rows per block are no LoRA of this model: rank r takes "
                         f"ceil(r x {widths.floats_per_rank()} / {widths.hidden_size}) rows "
                         f"({widths.rows(1)} for rank 1, {widths.rows(8)} for rank 8)")


@dataclass(frozen=True, eq=False)
class BlockAdapter:
    """A per-block adapter: ``kind`` (one of :data:`~swarm.adapters.kinds.PER_BLOCK_KINDS`) and ``weights``
    (blocks, R, hidden), block i's slice applied at the i-th block it is given to. Compared by identity: two
    values with equal weights are told apart by :meth:`digest`."""

    kind: str
    weights: torch.Tensor

    @property
    def blocks(self) -> int:
        return self.weights.shape[0]

    @property
    def rows(self) -> int:
        """R: rows of ``hidden`` per block."""
        return self.weights.shape[1]

    def slice(self, start: int, end: int) -> "BlockAdapter":
        """The adapter of blocks ``start:end`` (a hop's share of the whole model's adapter)."""
        return BlockAdapter(self.kind, self.weights[start:end])

    def detach(self) -> "BlockAdapter":
        """The same weights outside any autograd graph."""
        return BlockAdapter(self.kind, self.weights.detach())

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> "BlockAdapter":
        """The weights where the blocks compute (float32 by default: each block adds them in its own dtype)."""
        return BlockAdapter(self.kind, self.weights.to(device, dtype))

    def check(self, blocks: int, config: Any) -> None:
        """ValueError unless this adapter fits ``blocks`` blocks of a model of ``config`` (a
        :class:`~swarm.models.config.ModelConfig`): shape (blocks, R, hidden) and an R its kind can have."""
        weights, hidden = self.weights, int(config.hidden_size)
        if weights.dim() != 3 or weights.shape[0] != blocks or weights.shape[2] != hidden:
            raise ValueError(f"a {self.kind} of shape {tuple(weights.shape)} for {blocks} blocks: expected "
                             f"({blocks}, R, {hidden})")
        check_rows(self.kind, self.rows, BlockWidths.of(config))

    def enter(self, block: int, hidden: torch.Tensor, offset: int, config: Any
              ) -> tuple[torch.Tensor, Optional[BlockLoRA]]:
        """Block ``block``'s share (its index among this adapter's blocks): ``hidden`` (rows at absolute positions
        ``offset``...) as the block receives it, and the LoRA of its projections (None for the other kinds)."""
        weights = self.weights[block]
        if self.kind == LORA:
            return hidden, unpack_lora(weights, BlockWidths.of(config))
        if self.kind == BOTTLENECK:
            return add_bottleneck(hidden, weights), None
        return add_prompt(hidden, weights, offset), None

    def digest(self) -> str:
        """The name of the weights as they travel (float32): a hash of the kind, shape and bytes. A server files
        what it received under the digest it computes itself, so a name always means those bytes."""
        tensor = self.weights.detach().to(torch.float32).contiguous().cpu()
        digest = hashlib.sha256(MSGPackSerializer.dumps([DIGEST_DOMAIN, self.kind, list(tensor.shape)]))
        digest.update(tensor.view(torch.uint8).numpy().data if tensor.numel() else b"")
        return digest.hexdigest()

    def describe(self) -> str:
        """What the weights are, for messages: ``deep prompt vectors``, ``lora weights``."""
        return "deep prompt vectors" if self.kind == DEEP_PROMPT else f"{self.kind} weights"


def add_bottleneck(hidden: torch.Tensor, weights: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``hidden`` plus a small residual MLP of each row: ``silu(norm(h) @ down.T) @ up``, ``weights`` (2r, d) holding
    ``down`` (r, d) then ``up`` (r, d).

    Row by row, so a cache reuse that computes only some rows applies it exactly as the full pass did. The norm has
    no weight: the residual stream's scale grows with depth, and a fixed-scale input keeps one learning rate right
    for every block. ``up`` starts at zero, so a new adapter is the identity."""
    rank = weights.shape[0] // 2
    states = hidden.float()
    normed = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + eps)
    down, up = weights[:rank].float(), weights[rank:].float()
    return (states + F.silu(normed @ down.T) @ up).to(hidden.dtype)


def add_prompt(hidden: torch.Tensor, prompt: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """``hidden`` (rows at absolute positions ``offset``...) with ``prompt`` (P, d) added to the rows at absolute
    positions 0:P that it holds: one deep-prompt step, the same arithmetic in the local model and on a server.

    Added, not replacing: a zero prompt is the identity, so each block still sees what the blocks before made of
    the prompt rows, and the gradient flows through them to every earlier block's vectors."""
    length = hidden.shape[1]
    first, last = max(offset, 0), min(prompt.shape[0], offset + length)
    if first >= last:  # a cache reuse of rows after the prompt: nothing to add
        return hidden
    delta = F.pad(prompt[first:last].to(hidden.dtype), (0, 0, first - offset, offset + length - last))
    return hidden + delta
