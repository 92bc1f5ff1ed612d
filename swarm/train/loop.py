"""The training loop: resumable, seeded, writing native checkpoints."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from swarm.models.checkpoint import load_config, parse_dtype, save_checkpoint
from swarm.models.config import ModelConfig
from swarm.models.modules import DiffusionTransformer
from swarm.models.tokenizer import ByteTokenizer
from swarm.train.objective import diffusion_loss, mask_tokens

logger = logging.getLogger(__name__)

STATE_FILE = "training_state.pt"


@dataclass
class TrainConfig:
    output: str
    corpus: str = "prose"
    data_files: tuple[str, ...] = ()
    steps: int = 2000
    batch_size: int = 32
    seq_len: int = 128
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    hidden_size: int = 192
    layers: int = 16
    heads: int = 6
    kv_heads: int = 2
    intermediate_size: int = 512
    seed: int = 0
    save_every: int = 500
    save_dtype: str = "float16"
    threads: Optional[int] = None


def byte_model_config(cfg: TrainConfig) -> ModelConfig:
    tok = ByteTokenizer()
    return ModelConfig(
        vocab_size=tok.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_layers=cfg.layers, num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, mask_token_id=tok.MASK,
        pad_token_id=tok.PAD, bos_token_id=tok.BOS, eos_token_id=tok.EOS, max_position_embeddings=1024,
    )


def initialise(model: DiffusionTransformer) -> None:
    """Small normal init; output projections scaled down by depth (GPT-2 style) for stable training."""
    depth_scale = 1 / math.sqrt(2 * model.config.num_layers)
    for name, param in model.named_parameters():
        if param.dim() == 1:
            continue
        std = 0.02 * (depth_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
        torch.nn.init.normal_(param, std=std)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(cfg: TrainConfig, corpus) -> Path:
    """Train (or resume) and return the checkpoint directory."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    output = Path(cfg.output)
    state_path = output / STATE_FILE
    torch.manual_seed(cfg.seed)
    # On resume the architecture comes from the saved config, the weights from the full-precision state.
    model = DiffusionTransformer(load_config(output) if state_path.exists() else byte_model_config(cfg))
    initialise(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    generator = torch.Generator().manual_seed(cfg.seed)
    start = 0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        model.load_state_dict(state["model"])
        start = state["step"]
        logger.info("resuming %s at step %d", output, start)
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=f"train {cfg.corpus}")
    smoothed, started = None, time.time()
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        tokens = corpus.batch(cfg.batch_size, cfg.seq_len, generator)
        noisy, masked, t = mask_tokens(tokens, model.config.mask_token_id, generator)
        loss = diffusion_loss(model(noisy), tokens, masked, t)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        smoothed = loss.item() if smoothed is None else 0.98 * smoothed + 0.02 * loss.item()
        bar.set_postfix(loss=f"{smoothed:.3f}", lr=f"{learning_rate(cfg, step):.1e}")
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            save(model, optimizer, generator, step + 1, cfg)
    logger.info("trained %d steps in %.0f s", cfg.steps - start, time.time() - started)
    return output


def save(model: DiffusionTransformer, optimizer, generator: torch.Generator, step: int, cfg: TrainConfig) -> None:
    output = Path(cfg.output)
    save_checkpoint(output, model.config, model.native_state_dict(), dtype=parse_dtype(cfg.save_dtype))
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "generator": generator.get_state(),
                "step": step, "train_config": asdict(cfg)}, output / STATE_FILE)
