"""Click options shared by the commands that generate text (one definition, many commands)."""
from __future__ import annotations

from typing import Any, Callable

import click

from swarm.diffusion.remasking import STRATEGIES


def generation_options(command: Callable) -> Callable:
    """Add the sampler's settings as options; they arrive as keyword arguments of the same names."""
    options = [
        click.option("--gen-length", type=int, default=64, show_default=True, help="Number of tokens to generate."),
        click.option("--steps", type=int, default=None, help="Denoising steps (default: gen-length, one token per step)."),
        click.option("--block-length", type=int, default=None, help="Semi-autoregressive block size (default: 32 when it divides gen-length, else gen-length)."),
        click.option("--temperature", type=float, default=0.0, show_default=True, help="Gumbel noise scale; 0 is greedy."),
        click.option("--remasking", type=click.Choice(list(STRATEGIES)), default="low_confidence", show_default=True, help="Which masked positions are unmasked first."),
        click.option("--threshold", type=float, default=None, help="Unmask every position whose confidence reaches this (Fast-dLLM); at least one per step."),
        click.option("--cfg-scale", type=float, default=0.0, show_default=True, help="Unsupervised classifier-free guidance scale (0 disables)."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of the per-step noise: same seed, same tokens."),
        click.option("--parallel-window", type=int, default=1, show_default=True, help="Picard window: states evaluated per denoiser call (1 is sequential)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


GENERATION_KEYS = ("gen_length", "steps", "block_length", "temperature", "remasking", "threshold", "cfg_scale",
                   "seed", "parallel_window")


def pop_generation_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    return {key: options.pop(key) for key in GENERATION_KEYS if key in options}
