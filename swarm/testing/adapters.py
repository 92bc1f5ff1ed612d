"""Adapters made without training, for demonstrations and tests that need two adapters of different quality."""
from __future__ import annotations

from pathlib import Path

import torch

from swarm.adapters.adapter import AdapterConfig, SoftPrompt, base_of
from swarm.frontend.lm import BaseDiffusionLM


def random_soft_prompt(lm: BaseDiffusionLM, directory: Path, scale: float, length: int, seed: int = 0) -> Path:
    """A soft prompt of ``length`` random vectors of size ``scale`` for ``lm``'s model, saved in ``directory``: on the
    embedded addition model scale 5.0 and length 2 answer nearly every held-out sum, 1.0 and 4 about a third."""
    config = AdapterConfig(length, lm.config.hidden_size, base_of(lm.config, lm.tokenizer), training={"steps": 1})
    prompts = scale * torch.randn(length, lm.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    return SoftPrompt(config, prompts).save(directory)
