"""``python -m swarm.train``: train a masked-diffusion model of the project's own (LLaDA's objective).

The options come from :mod:`swarm.train.config` (plain data); torch is imported after the arguments are parsed.
"""
from __future__ import annotations

import logging
from typing import Optional

import click
from click.core import ParameterSource

from swarm.cli.options import SwarmCommand, apply_threads, run_main, setup_logging, threads_option
from swarm.train.config import ARCHITECTURE_FIELDS, BUILTIN_CORPORA, TrainConfig


def given_options(ctx: click.Context) -> set[str]:
    """The parameters the user set (command line or environment), not left at their default."""
    return {name for name in ctx.params if ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)}


@click.command(cls=SwarmCommand, context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option(
    "--output",
    required=True,
    type=click.Path(file_okay=False),
    help="Checkpoint directory (created; an existing one with training state is resumed).",
)
@click.option(
    "--corpus",
    type=click.Choice(BUILTIN_CORPORA),
    default="prose",
    help="Built-in training data: English prose (gensim test data), the Python standard library, "
         "or generated addition problems.",
)
@click.option(
    "--data",
    "data_files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Train on these text files instead of a built-in corpus (repeatable).",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=TrainConfig.steps,
    help="Total optimiser steps (a resumed run continues up to this number).",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=TrainConfig.batch_size, help="Sequences per step.")
@click.option("--seq-len", type=click.IntRange(min=2), default=TrainConfig.seq_len,
              help="Tokens per training sequence (including BOS).")
@click.option(
    "--lr",
    type=click.FloatRange(min=0, min_open=True),
    default=TrainConfig.lr,
    help="Peak learning rate (linear warm-up, cosine decay to 10%).",
)
@click.option("--warmup", type=click.IntRange(min=0), default=TrainConfig.warmup, help="Warm-up steps.")
@click.option("--hidden-size", type=click.IntRange(min=1), default=TrainConfig.hidden_size,
              help="Model width. This and the next four set the architecture of a new run; a resumed run keeps its "
                   "checkpoint's, and giving another value is refused.")
@click.option("--layers", type=click.IntRange(min=1), default=TrainConfig.layers, help="Number of transformer blocks.")
@click.option("--heads", type=click.IntRange(min=1), default=TrainConfig.heads, help="Attention heads.")
@click.option("--kv-heads", type=click.IntRange(min=1), default=TrainConfig.kv_heads,
              help="Key/value heads (grouped-query attention).")
@click.option("--intermediate-size", type=click.IntRange(min=1), default=TrainConfig.intermediate_size,
              help="SwiGLU hidden width.")
@click.option(
    "--seed",
    type=int,
    default=TrainConfig.seed,
    help="Seed of initialisation and data order: the same seed gives the same run.",
)
@click.option("--save-every", type=click.IntRange(min=1), default=TrainConfig.save_every,
              help="Write a checkpoint every N steps.")
@click.option(
    "--save-dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default=TrainConfig.save_dtype,
    help="dtype of the saved weights (training itself is float32).",
)
@click.option(
    "--tokenizer",
    default=TrainConfig.tokenizer,
    help="'byte', or a subword tokenizer for a new run: a tokenizer.json (python -m swarm.train.tokenizer writes "
         "one) or a directory holding one. It is copied into --output and shipped with the model.",
)
@click.option("--stop-at", type=click.IntRange(min=1), default=None,
              help="End this session after this step (a resumable checkpoint is written) without changing the "
                   "schedule, which --steps lays out: split one run over sessions, or look at it part-way.")
@threads_option()
def main(data_files: tuple[str, ...], stop_at: Optional[int], **options) -> None:
    """Train a masked-diffusion LM (byte or subword tokenizer) and write a native checkpoint.

    The defaults (2000 steps of 32 x 128 tokens) take hours on a CPU: the time per step, and what is left of
    the run, are logged after its first 3 steps."""
    from swarm.train.data import load_corpus  # after parsing: loads torch
    from swarm.train.loop import resume_conflicts, train, training_tokenizer

    setup_logging(logging.INFO)
    options["threads"] = apply_threads(options["threads"])
    cfg = TrainConfig(data_files=data_files, **options)
    given = given_options(click.get_current_context()) & set(ARCHITECTURE_FIELDS)
    conflicts = resume_conflicts(cfg, given)
    if conflicts:
        raise click.UsageError(f"{cfg.output} is resumed with its own architecture, which {', '.join(conflicts)} "
                               "would change: drop the flag, or train into a new --output")
    corpus = load_corpus(cfg.corpus, data_files, training_tokenizer(cfg))
    path = train(cfg, corpus, stop_at=stop_at)
    click.echo(f"checkpoint written to {path}")


if __name__ == "__main__":
    run_main(main)
