"""The training loop: resumable, seeded, writing native checkpoints.

A run is a deterministic function of its :class:`TrainConfig`: the initial weights come from the global
torch seed, while the data order and the masking noise come from one explicit generator whose state is
saved with the optimiser. Interrupting a run and resuming it therefore gives the same weights as running
it straight through (``tests/test_train.py`` checks this).
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from swarm.models.checkpoint import load_config, parse_dtype, save_checkpoint
from swarm.models.config import ModelConfig
from swarm.models.modules import DiffusionTransformer
from swarm.models.tokenizer import ByteTokenizer, SubwordTokenizer, Tokenizer
from swarm.train.config import ARCHITECTURE_FIELDS, TrainConfig
from swarm.train.data import Corpus, padding_mask
from swarm.train.objective import diffusion_loss, mask_tokens
from swarm.utils.text import plural

logger = logging.getLogger(__name__)

STATE_FILE = "training_state.pt"
# Shipped next to config.json: how the model was made (evaluation picks its default data from it).
TRAINING_INFO_FILE = "training.json"
# Flags that change what a resumed run computes; a mismatch is reported, not silently ignored.
RUN_DEFINING_FIELDS = ("corpus", "data_files", "batch_size", "seq_len", "lr", "warmup", "weight_decay", "seed", "steps")
ESTIMATE_AFTER_STEPS = 3  # steps timed before the time of the whole run is estimated (the first is the slowest)


@dataclass
class RunState:
    """What besides the model and optimiser a resumed run needs to continue exactly."""

    step: int = 0
    wall_s: float = 0.0  # training seconds summed over every session of the run
    smoothed_loss: Optional[float] = None


def training_tokenizer(cfg: TrainConfig) -> Tokenizer:
    """The run's tokenizer: bytes, or the subword vocabulary at ``cfg.tokenizer`` (a resumed run keeps its copy)."""
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    copy = Path(cfg.output) / SubwordTokenizer.FILE
    given = Path(cfg.tokenizer)
    path = copy if copy.exists() else given / SubwordTokenizer.FILE if given.is_dir() else given
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer at {cfg.tokenizer} (give a tokenizer.json or a directory holding one)")
    return SubwordTokenizer.from_file(path)


def new_model_config(cfg: TrainConfig, tokenizer: Tokenizer) -> ModelConfig:
    return ModelConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_layers=cfg.layers, num_heads=cfg.heads, num_kv_heads=cfg.kv_heads,
        mask_token_id=tokenizer.mask_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, max_position_embeddings=1024,
        tokenizer="byte" if isinstance(tokenizer, ByteTokenizer) else "bpe",
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
    """Linear warm-up to ``cfg.lr``, then cosine decay to 10% of it at ``cfg.steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def saved_architecture(output: Path) -> dict[str, int]:
    """The architecture fields of :class:`TrainConfig` as the checkpoint in ``output`` has them."""
    config = load_config(output)
    return {"hidden_size": config.hidden_size, "layers": config.num_layers, "heads": config.num_heads,
            "kv_heads": config.num_kv_heads, "intermediate_size": config.intermediate_size}


def resume_conflicts(cfg: TrainConfig, names: Iterable[str]) -> list[str]:
    """The architecture settings among ``names`` (those a user gave) that differ from the run being resumed,
    as ``--hidden-size 32 (the checkpoint has 64)``; empty when nothing is resumed."""
    output = Path(cfg.output)
    if not (output / STATE_FILE).exists():
        return []
    saved = saved_architecture(output)
    return [f"--{name.replace('_', '-')} {getattr(cfg, name)} (the checkpoint has {saved[name]})"
            for name in ARCHITECTURE_FIELDS if name in set(names) and getattr(cfg, name) != saved[name]]


def adopt_saved_architecture(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the resumed checkpoint's architecture, so that training.json records what was trained."""
    saved = saved_architecture(Path(cfg.output))
    ignored = [f"{name}={getattr(cfg, name)}" for name in ARCHITECTURE_FIELDS if getattr(cfg, name) != saved[name]]
    if ignored:
        logger.warning("ignoring %s on resume: the architecture comes from the saved config", ", ".join(ignored))
    return replace(cfg, **saved)


def duration(seconds: float) -> str:
    """``6780`` -> ``1 h 53 min``; ``250`` -> ``4 min 10 s``."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {secs} s" if minutes else f"{secs} s"


def train(cfg: TrainConfig, corpus: Corpus, *, stop_at: Optional[int] = None) -> Path:
    """Train (or resume) and return the checkpoint directory.

    ``stop_at`` ends this session after that step (saving a resumable checkpoint) without changing the
    schedule, which is always laid out over ``cfg.steps``: the way to split one run over several sessions.
    On resume the architecture comes from the saved config (differing settings are logged and replaced).
    """
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    output = Path(cfg.output)
    state_path = output / STATE_FILE
    if state_path.exists():
        cfg = adopt_saved_architecture(cfg)
    torch.manual_seed(cfg.seed)
    # On resume the architecture comes from the saved config, the weights from the full-precision state.
    tokenizer = training_tokenizer(cfg)
    model = DiffusionTransformer(load_config(output) if state_path.exists() else new_model_config(cfg, tokenizer))
    initialise(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    generator = torch.Generator().manual_seed(cfg.seed)
    run = restore(state_path, cfg, model, optimizer, generator) if state_path.exists() else RunState()
    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    first = run.step
    parameters = sum(p.numel() for p in model.parameters()) / 1e6
    logger.info("training steps %d..%d of %d (batch %d x %d tokens, %.2fM parameters, %s); the time it "
                "takes is estimated after %d steps", first, end, cfg.steps, cfg.batch_size, cfg.seq_len, parameters,
                plural(torch.get_num_threads(), "thread"), ESTIMATE_AFTER_STEPS)
    bar = tqdm(range(first, end), initial=first, total=cfg.steps, desc=f"train {cfg.corpus}")
    session_start, wall_before = time.perf_counter(), run.wall_s
    with logging_redirect_tqdm():  # log lines above the progress bar, not inside it
        for step in bar:
            if step - first == ESTIMATE_AFTER_STEPS:
                per_step = (time.perf_counter() - session_start) / ESTIMATE_AFTER_STEPS
                logger.info("%.2f s per step: about %s for the %s left (--steps sets the total)", per_step,
                            duration(per_step * (end - step)), plural(end - step, "step"))
            loss = train_step(model, optimizer, corpus, generator, cfg, step)
            run.smoothed_loss = loss if run.smoothed_loss is None else 0.98 * run.smoothed_loss + 0.02 * loss
            run.step = step + 1
            bar.set_postfix(loss=f"{run.smoothed_loss:.3f}", lr=f"{learning_rate(cfg, step):.1e}")
            if run.step % cfg.save_every == 0 or run.step == end:
                run.wall_s = wall_before + time.perf_counter() - session_start
                save(model, optimizer, generator, run, cfg, tokenizer)
    logger.info("trained steps %d..%d in %.0f s", first, end, time.perf_counter() - session_start)
    return output


def train_step(model: DiffusionTransformer, optimizer: torch.optim.Optimizer, corpus: Corpus,
               generator: torch.Generator, cfg: TrainConfig, step: int) -> float:
    """One optimiser step on a fresh batch; returns the batch's loss."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(cfg, step)
    tokens = corpus.batch(cfg.batch_size, cfg.seq_len, generator)
    noisy, masked, t = mask_tokens(tokens, model.config.mask_token_id, generator, given=corpus.given_positions(tokens))
    loss = diffusion_loss(model(noisy, padding_mask(tokens, model.config.pad_token_id)), tokens, masked, t)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


def restore(state_path: Path, cfg: TrainConfig, model: DiffusionTransformer, optimizer: torch.optim.Optimizer,
            generator: torch.Generator) -> RunState:
    """Load weights, optimiser and generator state in place; warn where the flags differ from the run's."""
    state = torch.load(state_path, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    generator.set_state(state["generator"])
    saved = state.get("train_config", {})
    for name in RUN_DEFINING_FIELDS:
        if name in saved and _comparable(saved[name]) != _comparable(getattr(cfg, name)):
            logger.warning("resuming with %s=%r but the run was started with %r: it will not match an "
                           "uninterrupted run", name, getattr(cfg, name), saved[name])
    run = RunState(step=state["step"], wall_s=state.get("wall_s", 0.0), smoothed_loss=state.get("smoothed_loss"))
    logger.info("resuming %s at step %d", state_path.parent, run.step)
    return run


def _comparable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def save(model: DiffusionTransformer, optimizer: torch.optim.Optimizer, generator: torch.Generator,
         run: RunState, cfg: TrainConfig, tokenizer: Tokenizer) -> None:
    """Write the checkpoint, its training record and the resumable state, each file replaced atomically.

    Files are written to a scratch folder first, so an interrupted save leaves the previous checkpoint
    whole; the state goes last, so it never points past the weights next to it.
    """
    output = Path(cfg.output)
    scratch = output / ".saving"
    shutil.rmtree(scratch, ignore_errors=True)
    save_checkpoint(scratch, model.config, model.native_state_dict(), dtype=parse_dtype(cfg.save_dtype))
    (scratch / TRAINING_INFO_FILE).write_text(json.dumps(training_info(cfg, run), indent=2) + "\n")
    if isinstance(tokenizer, SubwordTokenizer):
        tokenizer.save(scratch)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "generator": generator.get_state(),
                "step": run.step, "wall_s": run.wall_s, "smoothed_loss": run.smoothed_loss,
                "train_config": asdict(cfg)}, scratch / STATE_FILE)
    for path in sorted(scratch.iterdir(), key=lambda p: p.name == STATE_FILE):
        os.replace(path, output / path.name)
    scratch.rmdir()


def training_info(cfg: TrainConfig, run: RunState) -> dict[str, Any]:
    """The record shipped with a model: the settings that made it and how far it got."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("output", "threads", "save_every", "tokenizer")}
    if cfg.tokenizer != "byte":
        settings["tokenizer"] = SubwordTokenizer.FILE  # shipped next to the weights, wherever it was trained from
    return {"train_config": settings, "step": run.step, "wall_s": round(run.wall_s, 1),
            "smoothed_loss": None if run.smoothed_loss is None else round(run.smoothed_loss, 4)}
