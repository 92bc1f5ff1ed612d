"""A trusted answer to any span call: the call recomputed from this process's own copy of the blocks (issue 48).

An auditor holds every block and checks servers against its own pass; a client whose checkpoint holds the blocks
(the project's own models, a downloaded LLaDA) can do the same when no other server holds a hop's blocks. The
recomputation is the server's own (``SpanBackend.forward_sync``) restated on the model's modules: the blocks in the
compute dtype with the call's per-block adapter, a cache fill or reuse rebuilt from the fill's input (the client keeps
it while checks run), and a head query answered with :meth:`OutputHead.scored_logits` and
:func:`~swarm.diffusion.prediction.predict_states`, so an honest server's answer and this one agree to rounding.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

import torch

from swarm.diffusion.prediction import predict_states
from swarm.models.kv_cache import SpanKV
from swarm.models.modules import BlockSpan, OutputHead
from swarm.wire.messages import ForwardRequest

logger = logging.getLogger(__name__)

LOCAL = "local"  # the checker a spot-check outcome names when this process recomputed the hop itself


class LocalReference:
    """Recomputes span calls as an honest server would. ``load_blocks(start, end)`` gives a span holding those blocks
    (an auditor's copy of all of them, or a client's load of just a hop's: a client loads only the hops it has to
    check itself, each once); the head is loaded at the first head query. With ``num_blocks``, the hops loaded never
    hold more blocks than the model: a hop that would pass that bound loads the whole model once instead."""

    def __init__(self, load_blocks: Callable[[int, int], BlockSpan], load_head: Callable[[], OutputHead],
                 num_blocks: Optional[int] = None):
        self._load_blocks, self._load_head, self.num_blocks = load_blocks, load_head, num_blocks
        self._spans: dict[tuple[int, int], BlockSpan] = {}  # the hops loaded, or one entry: the whole model
        self._lock = threading.Lock()  # calls in flight (stale pipelining) may check at once

    def to_load(self, start: int, end: int) -> Optional[tuple[int, int]]:
        """The blocks a recomputation of ``start:end`` would load now (the hop's, or the whole model's when the
        hops held would pass ``num_blocks``); None when they are held already."""
        if any(a <= start and end <= b for a, b in self._spans):
            return None
        if self.num_blocks is not None and sum(b - a for a, b in self._spans) + end - start > self.num_blocks:
            return 0, self.num_blocks
        return start, end

    def blocks(self, start: int, end: int) -> BlockSpan:
        with self._lock:
            load = self.to_load(start, end)
            if load is None:
                return next(span for (a, b), span in self._spans.items() if a <= start and end <= b)
            if load != (start, end):
                self._spans.clear()
            logger.info("loading blocks %d:%d here to recompute spot-checked hops", *load)
            span = self._spans[load] = self._load_blocks(*load).requires_grad_(False)
            return span

    @torch.inference_mode()
    def answer(self, request: ForwardRequest, fill_input: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What an honest server answers to ``request``: hidden states, or predictions when it carries a head query.
        A cache reuse needs ``fill_input``, the hidden states its fill was computed from (ValueError without)."""
        blocks = (request.start, request.end)
        span = self.blocks(*blocks)
        dtype = next(span.parameters()).dtype
        kv, rows = None, None
        if request.cache is not None and not request.cache.fill:
            if fill_input is None:
                raise ValueError(f"cannot recompute a reuse of blocks {request.start}:{request.end} without its fill")
            kv, rows = SpanKV(fill_input.shape[0], fill_input.shape[1]), request.cache.rows
            span(fill_input.to(dtype), blocks=blocks, kv=kv, adapter=request.adapter)
        hidden = span(request.hidden.to(dtype), blocks=blocks, kv=kv, rows=rows, adapter=request.adapter).to(dtype)
        if request.head is None:
            return hidden
        logits = self._load_head().scored_logits(hidden, rows[0] if rows is not None else 0, request.head.scored)
        return predict_states(logits, request.head)
