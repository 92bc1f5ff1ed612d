"""The three pieces a model is split into: token embedding, a span of blocks, and the output head.

A client holds the embedding and head; servers hold spans. Parameter names are the native checkpoint's
names (``embed.weight``, ``blocks.{i}.…``, ``norm.weight``, ``lm_head.weight``) with *global* block
indices, so a span's ``state_dict`` keys are exactly the checkpoint keys it needs.
"""
from __future__ import annotations

import threading
from typing import Optional, Protocol

import torch
from torch import nn

from swarm.models import invariance
from swarm.models.config import ModelConfig
from swarm.models.kv_cache import SpanKV
from swarm.models.layers import BlockLoRA, RMSNorm, TransformerBlock, low_rank, rotary_cos_sin
from swarm.utils.errors import SwarmError

HeadLoRA = tuple[torch.Tensor, torch.Tensor]  # an adapter's head correction: down (r, hidden), up (vocab, r)


class SpanAdapter(Protocol):
    """A per-block adapter as a span applies it (:class:`swarm.adapters.block.BlockAdapter`; the model layer knows
    only this much of it)."""

    def check(self, blocks: int, config: ModelConfig) -> None:
        """ValueError unless it fits ``blocks`` blocks of this model."""

    def enter(self, block: int, hidden: torch.Tensor, offset: int, config: ModelConfig
              ) -> tuple[torch.Tensor, Optional[BlockLoRA]]:
        """The states block ``block`` (its index among the adapter's blocks) receives, and its projections' LoRA."""


class PassCancelled(SwarmError):
    """A pass stopped between blocks because its ``cancel`` event was set: nobody would read its answer."""


class TokenEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # Built on the meta device to be loaded (load_module), the matrix needs no random draw: normal_ on the meta
        # device imports torch's symbolic machinery (sympy and 800 modules: 69 MB that a client then holds for nothing)
        weight = torch.empty(config.vocab_size, config.hidden_size) if torch.empty(()).is_meta else None
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)


def default_positions(batch: int, length: int, device: torch.device) -> torch.Tensor:
    return torch.arange(length, device=device).expand(batch, length)


class BlockSpan(nn.Module):
    """Blocks ``[start, end)`` of the model; only those blocks are allocated."""

    def __init__(self, config: ModelConfig, start: int, end: int):
        super().__init__()
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(f"span {start}:{end} is not inside the model's {config.num_layers} blocks")
        self.config, self.start, self.end = config, start, end
        self.blocks = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(start, end)})

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        blocks: Optional[tuple[int, int]] = None,
        kv: Optional[SpanKV] = None,
        rows: Optional[tuple[int, int]] = None,
        adapter: Optional[SpanAdapter] = None,
        cancel: Optional[threading.Event] = None,
    ) -> torch.Tensor:
        """hidden (batch, length, d); attention_mask (batch, length) bool, True for real tokens.

        ``blocks=(a, b)`` runs only the held blocks ``a:b`` (a server may serve part of its span).
        ``kv`` with ``rows`` None fills the cache from this full pass; with ``rows=(a, b)`` the hidden states
        are those rows only and every other position's keys and values come from the cache.
        ``adapter``: a per-block adapter (:class:`swarm.adapters.block.BlockAdapter`) for the blocks run, block i's
        share applied as it enters block i: a deep prompt's vectors, added to the absolute positions 0:R, or a
        bottleneck adapter's weights, applied to every row; or a LoRA of the block's projections.
        ``cancel``: checked before each block; once set, :class:`PassCancelled` is raised, so a server stops a
        pass whose caller has gone within one block's time (a cache being filled is then dropped by its caller).
        """
        batch, length, _ = hidden.shape
        if position_ids is None:
            position_ids = default_positions(batch, length, hidden.device)
            if rows is not None:
                position_ids = position_ids + rows[0]
        start, end = blocks if blocks is not None else (self.start, self.end)
        if not self.start <= start < end <= self.end:
            raise ValueError(f"blocks {start}:{end} are not inside the held span {self.start}:{self.end}")
        if rows is not None and kv is None:
            raise ValueError("rows without a cache: a partial pass needs the cached keys and values")
        if kv is not None and rows is not None:
            if length != rows[1] - rows[0]:
                raise ValueError(f"{length} hidden rows given for rows {rows[0]}:{rows[1]}")
            kv.check_reuse(start, end, batch, rows)
        if adapter is not None:
            adapter.check(end - start, self.config)
        cos, sin = rotary_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, hidden.dtype)
        offset = rows[0] if rows is not None else 0
        for index in range(start, end):
            if cancel is not None and cancel.is_set():
                raise PassCancelled(f"pass cancelled before block {index}")
            lora: Optional[BlockLoRA] = None
            if adapter is not None:
                hidden, lora = adapter.enter(index - start, hidden, offset, self.config)
            hidden = self.blocks[str(index)](hidden, cos, sin, attention_mask,
                                             kv.block(index) if kv is not None else None, rows, lora)
        return hidden


class OutputHead(nn.Module):
    """Final RMSNorm and the vocabulary projection, with the model's logit alignment applied."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor, lora: Optional[HeadLoRA] = None) -> torch.Tensor:
        """Logits of every row; ``lora`` is an adapter's low-rank correction of the projection (client side)."""
        return align_logits(self.project(hidden, lora), self.config)

    def project(self, hidden: torch.Tensor, lora: Optional[HeadLoRA] = None) -> torch.Tensor:
        """``lm_head(norm(hidden))``, plus ``(normed @ down.T) @ up.T`` when a ``lora`` (down (r, d), up (vocab, r))
        is given: the one place an adapter's head correction enters, for training and generation alike."""
        normed = self.norm(hidden)
        logits = invariance.linear(normed, self.lm_head.weight)
        if lora is None:
            return logits
        return logits + low_rank(normed, lora).to(logits.dtype)

    def score_rows(self, hidden: torch.Tensor, offset: int, scored: tuple[int, int],
                   lora: Optional[HeadLoRA] = None) -> torch.Tensor:
        """Float32 logits of ``hidden`` (rows at absolute positions ``offset``...), the head computed only for the
        absolute positions ``scored`` = (a, b): at LLaDA-8B's widths the head costs as much as a block per row,
        and the sampler reads one block. Every other row is NaN, so that a reader of a row never asked for
        fails loudly instead of using stale numbers."""
        batch, length, _ = hidden.shape
        first, last = max(scored[0] - offset, 0), min(scored[1] - offset, length)
        out = torch.full((batch, length, self.config.vocab_size), float("nan"), dtype=torch.float32,
                         device=hidden.device)
        if first < last:
            out[:, first:last] = self.scored_logits(hidden, offset, scored, lora)
        return out

    def scored_logits(self, hidden: torch.Tensor, offset: int, scored: tuple[int, int],
                      lora: Optional[HeadLoRA] = None) -> torch.Tensor:
        """Float32 logits (batch, rows, vocab) of the absolute positions ``scored`` that ``hidden`` holds (its rows
        start at ``offset``): the one computation behind every head of the project, in the client, the local
        model and a head server, so that they agree to the bit. Row alignment is :func:`align_logits`'s
        (Dream's row i is scored from hidden row i - 1)."""
        first, last = max(scored[0] - offset, 0), min(scored[1] - offset, hidden.shape[1])
        shift = 1 if self.config.logits_shift else 0
        source = (torch.arange(first, last, device=hidden.device) - shift).clamp(min=0)
        return self.project(hidden[:, source], lora).float()


def align_logits(logits: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Make position i score token i. Dream predicts token i from hidden state i-1, so shift right by one."""
    if not config.logits_shift:
        return logits
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


class DiffusionTransformer(nn.Module):
    """The whole model in one process: embedding, every block, head."""

    def __init__(
        self, config: ModelConfig, parts: Optional[tuple[TokenEmbedding, BlockSpan, OutputHead]] = None
    ):
        """Freshly initialised, or assembled from ``parts`` already loaded from a checkpoint."""
        super().__init__()
        self.config = config
        if parts is None:
            parts = (TokenEmbedding(config), BlockSpan(config, 0, config.num_layers), OutputHead(config))
        self.embedding, self.span, self.head = parts

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                kv: Optional[SpanKV] = None, rows: Optional[tuple[int, int]] = None,
                scored: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """Logits of ``input_ids``; with ``rows`` the ids are those rows only (see :meth:`BlockSpan.forward`);
        with ``scored`` only those absolute positions get logits (:meth:`OutputHead.score_rows`)."""
        hidden = self.span(self.embedding(input_ids), attention_mask, kv=kv, rows=rows)
        if scored is None:
            return self.head(hidden)
        return self.head.score_rows(hidden, rows[0] if rows is not None else 0, scored)

    def native_state_dict(self) -> dict[str, torch.Tensor]:
        """State dict under checkpoint names (the wrapper modules' prefixes stripped)."""
        out: dict[str, torch.Tensor] = {}
        for part in (self.embedding, self.span, self.head):
            out.update(part.state_dict())
        if self.config.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out
