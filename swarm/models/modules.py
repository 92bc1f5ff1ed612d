"""The three pieces a model is split into: token embedding, a span of blocks, and the output head.

A client holds the embedding and head; servers hold spans. Parameter names are the native checkpoint's
names (``embed.weight``, ``blocks.{i}.…``, ``norm.weight``, ``lm_head.weight``) with *global* block
indices, so a span's ``state_dict`` keys are exactly the checkpoint keys it needs.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from swarm.models.config import ModelConfig
from swarm.models.kv_cache import SpanKV
from swarm.models.layers import RMSNorm, TransformerBlock, rotary_cos_sin
from swarm.models.lora import LORA, BlockLoRA, BlockWidths, unpack_lora
from swarm.utils.errors import SwarmError

DEEP_PROMPT = "deep_prompt"
BOTTLENECK = "bottleneck"
# adapters whose tensor has a slice per block, (blocks, R, hidden): a deep prompt's vectors and a bottleneck's
# weights are applied to the rows before each block, a LoRA's inside it (swarm/models/lora.py)
BLOCK_ADAPTER_KINDS = (DEEP_PROMPT, BOTTLENECK, LORA)
HeadLoRA = tuple[torch.Tensor, torch.Tensor]  # an adapter's head correction: down (r, hidden), up (vocab, r)


class PassCancelled(SwarmError):
    """A pass stopped between blocks because its ``cancel`` event was set: nobody would read its answer."""


class TokenEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)

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
        prompts: Optional[torch.Tensor] = None,
        prompt_kind: str = DEEP_PROMPT,
        cancel: Optional[threading.Event] = None,
    ) -> torch.Tensor:
        """hidden (batch, length, d); attention_mask (batch, length) bool, True for real tokens.

        ``blocks=(a, b)`` runs only the held blocks ``a:b`` (a server may serve part of its span).
        ``kv`` with ``rows`` None fills the cache from this full pass; with ``rows=(a, b)`` the hidden states
        are those rows only and every other position's keys and values come from the cache.
        ``prompts`` (blocks run, R, d): an adapter's tensor for each block run, applied before the block as
        ``prompt_kind`` says (:func:`apply_block_adapter`): a deep prompt's vectors, added to the absolute positions
        0:R, or a bottleneck adapter's weights, applied to every row; or a LoRA of the block's projections.
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
        widths = BlockWidths.of(self.config) if prompts is not None else None  # only a per-block adapter needs them
        if prompts is not None:
            if prompts.dim() != 3 or prompts.shape[0] != end - start or prompts.shape[2] != hidden.shape[2]:
                raise ValueError(f"prompts of shape {tuple(prompts.shape)} for blocks {start}:{end}: expected "
                                 f"({end - start}, R, {hidden.shape[2]})")
            check_block_adapter(prompt_kind, prompts.shape[1], widths)
        cos, sin = rotary_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, hidden.dtype)
        offset = rows[0] if rows is not None else 0
        for index in range(start, end):
            if cancel is not None and cancel.is_set():
                raise PassCancelled(f"pass cancelled before block {index}")
            lora: Optional[BlockLoRA] = None
            if prompts is not None and prompt_kind == LORA:
                lora = unpack_lora(prompts[index - start], widths)
            elif prompts is not None:
                hidden = apply_block_adapter(prompt_kind, hidden, prompts[index - start], offset)
            hidden = self.blocks[str(index)](hidden, cos, sin, attention_mask,
                                             kv.block(index) if kv is not None else None, rows, lora)
        return hidden


def check_block_adapter(kind: str, rows: int, widths: BlockWidths) -> None:
    """A per-block adapter tensor of ``rows`` rows per block must be of a known kind (a bottleneck's rows are its
    down and up projections, so an even number; a LoRA's, its packed projections of some rank)."""
    if kind not in BLOCK_ADAPTER_KINDS:
        raise ValueError(f"unknown per-block adapter kind {kind!r}; known: {', '.join(BLOCK_ADAPTER_KINDS)}")
    if kind == BOTTLENECK and rows % 2:
        raise ValueError(f"a bottleneck adapter's tensor holds 2 x rank rows per block, got {rows}")
    if kind == LORA and widths.rank(rows) is None:
        raise ValueError(f"{rows} rows per block are no LoRA of this model: rank r takes "
                         f"ceil(r x {widths.floats_per_rank()} / {widths.hidden_size}) rows "
                         f"({widths.rows(1)} for rank 1, {widths.rows(8)} for rank 8)")


def apply_block_adapter(kind: str, hidden: torch.Tensor, weights: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """One block's share of a per-block adapter, applied to ``hidden`` before the block (rows at absolute positions
    ``offset``...): the one function the local model and every server run, so their tokens agree."""
    if kind == BOTTLENECK:
        return add_bottleneck(hidden, weights)
    return add_prompt(hidden, weights, offset)


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
        logits = self.lm_head(normed)
        if lora is None:
            return logits
        down, up = lora
        return logits + ((normed.float() @ down.float().T) @ up.float().T).to(logits.dtype)

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
