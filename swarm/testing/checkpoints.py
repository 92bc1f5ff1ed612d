"""A tiny native checkpoint with random weights: what most tests and the measuring scripts run the swarm on."""
from __future__ import annotations

from pathlib import Path

import torch

from swarm.models.checkpoint import save_checkpoint
from swarm.models.config import ModelConfig
from swarm.models.modules import DiffusionTransformer
from swarm.models.tokenizer import ByteTokenizer


def tiny_config(**changes) -> ModelConfig:
    """A 4-block model of width 32 over the byte tokenizer; ``changes`` override any field."""
    tok = ByteTokenizer()
    base = dict(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        mask_token_id=tok.MASK, pad_token_id=tok.PAD, bos_token_id=tok.BOS, eos_token_id=tok.EOS,
        rope_theta=10000.0, max_position_embeddings=512,
    )
    base.update(changes)
    return ModelConfig(**base)


def make_checkpoint(directory: Path, config: ModelConfig, seed: int = 0, max_shard_bytes=None) -> Path:
    """A randomly initialised model with weights large enough that outputs depend on every block."""
    torch.manual_seed(seed)
    model = DiffusionTransformer(config)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.2 if param.dim() > 1 else 1.0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
    save_checkpoint(directory, config, model.native_state_dict(), max_shard_bytes=max_shard_bytes)
    return directory
