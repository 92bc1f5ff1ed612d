"""The whole model in one process: the single-node scale and the reference the swarm is checked against."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from swarm.adapters.adapter import PromptAdapter
from swarm.adapters.block import BlockAdapter
from swarm.dht.compatibility import CompatibilityTag, IncompatibleExpertError
from swarm.diffusion.config import GenerationConfig
from swarm.diffusion.experts import ExpertNotFoundError, InProcessExpert
from swarm.diffusion.pipeline import CacheDirective, Forward, check_head_rows, rows_to_score
from swarm.diffusion.sampler import DenoiseContext
from swarm.frontend.lm import BaseDiffusionLM
from swarm.models.invariance import DeviceInvariance, check_module
from swarm.models.kv_cache import CacheMiss, SpanKV
from swarm.models.loading import DEFAULT_MODEL, ModelFiles, resolve_device
from swarm.models.modules import DiffusionTransformer, HeadLoRA
from swarm.models.tokenizer import Tokenizer
from swarm.utils.threads import use_threads


class DiffusionLM(BaseDiffusionLM):
    """``DiffusionLM.from_pretrained("default").generate("Once upon a time", gen_length=64)``."""

    def __init__(self, model: DiffusionTransformer, tokenizer: Tokenizer, path: Optional[Path] = None,
                 head_rows: str = "active"):
        """``head_rows="active"`` scores only the rows the sampler reads (:func:`scored_rows`), as the
        distributed client does, so that both give the same tokens; ``"all"`` scores every row."""
        self.model = model.eval()
        self.config = model.config
        self.tokenizer = tokenizer
        self.path = path
        self.head_rows = check_head_rows(head_rows)
        self.device = next(model.parameters()).device
        self._experts: dict[str, "DiffusionLM"] = {}  # loaded once, reused by later requests

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path = DEFAULT_MODEL, *, dtype: Optional[str] = None,
                        device: str = "cpu", head_rows: str = "active", threads: Optional[int] = None) -> "DiffusionLM":
        """``dtype`` None: the checkpoint's (bfloat16 for LLaDA / Dream, float32 for the project's own models),
        as servers default to; ``device`` "cuda" fails clearly without CUDA. ``threads``: torch's CPU threads, set
        for the process as the commands set them (:func:`~swarm.utils.threads.use_threads`)."""
        use_threads(threads)
        target = resolve_device(device)
        files = ModelFiles(name_or_path)
        lm = cls(files.full_model(dtype).to(target), files.tokenizer(), files.path, head_rows)
        lm.sampling_defaults = files.sampling_defaults()
        return lm

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
               adapter: Optional[str] = None) -> torch.Tensor:
        """Per-position logits (batch, length, vocab) in float32 on the CPU; position i scores token i. With
        ``adapter`` (a directory or, on the swarm client, a published name) the adapted model's, as generation
        with that adapter computes them."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        # True (or 1, as a transformers tokenizer's mask) for real tokens
        mask = attention_mask.to(self.device).bool() if attention_mask is not None else None
        return self._pass(input_ids.to(self.device), self.load_adapter(adapter), attention_mask=mask)

    def batch_invariance(self) -> DeviceInvariance:
        return check_module(self.model)

    def backbone(self) -> "LocalBackbone":
        return LocalBackbone(self)

    def open_experts(self, names: Sequence[str], required: bool) -> tuple[dict[str, InProcessExpert], list[str]]:
        """Experts by embedded name or checkpoint directory, loaded into this process in their own dtype."""
        backbone = CompatibilityTag.of(self.config, self.tokenizer)
        sources, warnings = {}, []
        for name in names:
            try:
                expert = self._expert(name, backbone)
            except (ExpertNotFoundError, IncompatibleExpertError) as error:
                if required:
                    raise
                warnings.append(f"{error} (skipped)")
                continue
            sources[name] = InProcessExpert(expert.logits, str(expert.path))
        return sources, warnings

    def _expert(self, name: str, backbone: CompatibilityTag) -> "DiffusionLM":
        expert = self._experts.get(name)
        if expert is None:
            try:
                expert = DiffusionLM.from_pretrained(name)
            except FileNotFoundError as error:
                raise ExpertNotFoundError(f"expert {name!r}: {error}") from None
            backbone.require_compatible(CompatibilityTag.of(expert.config, expert.tokenizer), name)
            self._experts[name] = expert
        return expert

    @contextlib.contextmanager
    def denoising_session(self, generation: GenerationConfig,
                          adapter: Optional[PromptAdapter] = None) -> Iterator[Forward]:
        """Passes over the whole model; cache directives keep this generation's keys and values in ``kv``."""
        kv: Optional[SpanKV] = None
        extra_rows = adapter.length if adapter is not None else 0

        @torch.inference_mode()
        def forward(tokens: torch.Tensor, directive: Optional[CacheDirective], context: DenoiseContext) -> torch.Tensor:
            nonlocal kv
            scored = rows_to_score(self.head_rows, context, generation, tokens.shape[1])
            tokens = tokens.to(self.device)
            if directive is None:
                return self._pass(tokens, adapter, scored=scored)
            if directive.fill:
                kv = SpanKV(tokens.shape[0], tokens.shape[1] + extra_rows)
                return self._pass(tokens, adapter, kv=kv, scored=scored)
            if kv is None:
                raise CacheMiss("nothing filled yet")
            start, end = directive.rows
            return self._pass(tokens[:, start:end], adapter, kv=kv, rows=(start, end), scored=scored)

        yield forward

    def _pass(self, tokens: torch.Tensor, adapter: Optional[PromptAdapter], kv: Optional[SpanKV] = None,
              rows: Optional[tuple[int, int]] = None, scored: Optional[tuple[int, int]] = None,
              attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Float32 logits of one denoiser call; an adapter's prompt positions go first (a reuse's rows shift past
        them, as the cache holds them; the padding mask, full passes only, attends to them), a per-block adapter's
        tensor applies before each block, and the prompt rows are sliced off before the head."""
        if adapter is None:
            return self.model(tokens, attention_mask, kv=kv, rows=rows, scored=scored).float().cpu()
        model = self.model
        hidden = model.embedding(tokens)
        if rows is None:
            mask = None if attention_mask is None else F.pad(attention_mask, (adapter.length, 0), value=True)
            hidden = adapter.strip(model.span(adapter.extend(hidden), mask, kv=kv, adapter=adapter.block_adapter))
        else:
            hidden = model.span(hidden, kv=kv, rows=adapter.shift(rows), adapter=adapter.block_adapter)
        lora = adapter.head_lora
        logits = (model.head(hidden, lora) if scored is None
                  else model.head.score_rows(hidden, rows[0] if rows else 0, scored, lora))
        return logits.float().cpu()


class LocalBackbone:
    """Every block in this process, as :class:`swarm.frontend.lm.Backbone` pieces (the model's weights frozen)."""

    through_swarm = False

    def __init__(self, lm: DiffusionLM):
        self.model, self.config = lm.model, lm.config
        self.model.requires_grad_(False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embedding(ids)

    def blocks(self, hidden: torch.Tensor, adapter: Optional[BlockAdapter] = None) -> torch.Tensor:
        return self.model.span(hidden, adapter=adapter)

    def head(self, hidden: torch.Tensor, lora: Optional[HeadLoRA] = None) -> torch.Tensor:
        return self.model.head(hidden, lora)
