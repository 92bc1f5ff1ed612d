"""The swarm client as pieces to train an adapter through (:class:`swarm.frontend.lm.Backbone`): the client's
embedding and head, and every block on the swarm as one differentiable function.

Its forward is the client's ordinary pass (recording each hop's input); its backward asks each hop's server for the
gradient of its input and of its blocks' slice of the adapter (:meth:`RemoteSequence.backward_all`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from swarm.adapters.block import BlockAdapter
from swarm.client.sequence import HopTrace, RemoteSequence
from swarm.models.config import ModelConfig
from swarm.models.modules import HeadLoRA, OutputHead, TokenEmbedding


class SwarmBlocks(torch.autograd.Function):
    """Every block through the swarm as one differentiable function of the hidden states (and of a per-block
    adapter's weights, when given: None for a soft prompt)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weights: Optional[torch.Tensor], sequence: RemoteSequence,
                kind: str) -> torch.Tensor:
        trace: list[HopTrace] = []
        adapter = BlockAdapter(kind, weights.detach()) if weights is not None else None
        output = sequence.forward(hidden.detach(), trace=trace, adapter=adapter)
        ctx.sequence, ctx.trace, ctx.dtype, ctx.adapter = sequence, trace, hidden.dtype, adapter
        return output.to(hidden.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor], None, None]:
        grad_hidden, grad_weights = ctx.sequence.backward_all(ctx.trace, grad.float(), ctx.adapter)
        return grad_hidden.to(ctx.dtype), grad_weights, None, None


class SwarmBackbone:
    """The client's embedding and head (frozen), the blocks on the swarm."""

    through_swarm = True

    def __init__(self, config: ModelConfig, sequence: RemoteSequence, embedding: TokenEmbedding, head: OutputHead,
                 compute_dtype: torch.dtype):
        self.config, self.sequence, self.compute_dtype = config, sequence, compute_dtype
        self.embedding, self._head = embedding.requires_grad_(False), head.requires_grad_(False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids)

    def blocks(self, hidden: torch.Tensor, adapter: Optional[BlockAdapter] = None) -> torch.Tensor:
        weights, kind = (adapter.weights, adapter.kind) if adapter is not None else (None, "")
        return SwarmBlocks.apply(hidden, weights, self.sequence, kind)

    def head(self, hidden: torch.Tensor, lora: Optional[HeadLoRA] = None) -> torch.Tensor:
        return self._head(hidden.to(self.compute_dtype), lora)
