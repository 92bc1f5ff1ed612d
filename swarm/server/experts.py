"""Hosting whole expert models: naming and loading them, measuring them, computing their log-probabilities.

An expert is a small complete model that shares the backbone's tokenizer; a server hosting it answers
"token ids in, log-probabilities of some positions out" (:mod:`swarm.server.expert_handler`), and the
client composes those with the backbone's (:mod:`swarm.diffusion.composition`).
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Optional

import torch

from swarm.dht.compatibility import CompatibilityTag
from swarm.dht.schema import default_prefix
from swarm.diffusion.experts import block_log_probs
from swarm.models.config import ModelConfig
from swarm.models.loading import ModelFiles, dtype_name
from swarm.models.modules import DiffusionTransformer
from swarm.server.backend import ComputeQueue

logger = logging.getLogger(__name__)

DOMAIN_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
REFERENCE_TOKENS = 128


@dataclass(frozen=True)
class ExpertSpec:
    domain: str  # the name clients ask for: ``experts={"addition": 1.0}``
    model: str  # an embedded model's name or a checkpoint directory


def parse_expert_spec(text: str) -> ExpertSpec:
    """``NAME_OR_PATH`` (the domain is the model's directory name) or ``DOMAIN=NAME_OR_PATH``."""
    domain, separator, model = text.partition("=")
    if not separator:
        model, domain = text, ""
    if not model:
        raise ValueError(f"--expert {text!r}: expected NAME_OR_PATH or DOMAIN=NAME_OR_PATH")
    if not domain:
        domain = default_prefix(ModelFiles(model).path)
    if not DOMAIN_PATTERN.match(domain):
        raise ValueError(f"--expert {text!r}: the domain must be 1-64 letters, digits, '_' or '-', got {domain!r}")
    return ExpertSpec(domain, model)


def default_dtype(files: ModelFiles, requested: Optional[str]) -> str:
    """The checkpoint's compute dtype (:attr:`ModelFiles.default_dtype`), unless asked otherwise."""
    return requested or dtype_name(files.default_dtype)


@dataclass
class HostedExpert:
    domain: str
    label: str  # what was loaded, for records and logs
    model: DiffusionTransformer
    config: ModelConfig
    tag: CompatibilityTag
    throughput: float = 0.0


def load_expert(spec: ExpertSpec, device: str = "cpu", dtype: Optional[str] = None) -> HostedExpert:
    files = ModelFiles(spec.model)
    model = files.full_model(default_dtype(files, dtype)).to(device).eval()
    logger.info("loaded expert %r from %s", spec.domain, files.path)
    tag = CompatibilityTag.of(files.config, files.tokenizer())
    return HostedExpert(spec.domain, files.path.name, model, files.config, tag)


@torch.inference_mode()
def measure_expert_throughput(expert: HostedExpert, device: str = "cpu", repeats: int = 3) -> float:
    """Tokens per second through the whole model for one sequence of up to 128 tokens (best of ``repeats``)."""
    length = min(REFERENCE_TOKENS, expert.config.max_position_embeddings)
    tokens = torch.randint(0, expert.config.vocab_size, (1, length), device=device)
    expert.model(tokens)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        expert.model(tokens)
        best = min(best, time.perf_counter() - started)
    return length / max(best, 1e-6)


class ExpertBackend:
    """Runs hosted experts on one compute thread; refuses work beyond its bounds as busy."""

    def __init__(self, experts: dict[str, HostedExpert], max_concurrent: int, device: str = "cpu",
                 max_queued_tokens: Optional[int] = None, peer_share: float = 1.0):
        self.experts = experts
        self.device = torch.device(device)
        self.queue = ComputeQueue(max_concurrent, max_queued_tokens, "expert-compute", peer_share)

    @property
    def in_flight(self) -> int:
        return self.queue.in_flight

    @torch.inference_mode()
    def log_probs_sync(self, expert: HostedExpert, tokens: torch.Tensor, start: int, end: int) -> torch.Tensor:
        logits = expert.model(tokens.to(self.device))
        return block_log_probs(logits, start, end).cpu()

    async def log_probs(self, expert: HostedExpert, tokens: torch.Tensor, start: int, end: int,
                        peer: str = "") -> torch.Tensor:
        return await self.queue.run(tokens.numel(), self.log_probs_sync, expert, tokens, start, end, peer=peer)

    def shutdown(self) -> None:
        self.queue.shutdown()
