"""``python -m swarm.train``: train a byte-level masked-diffusion model (LLaDA's objective)."""
from __future__ import annotations

import logging

import click

from swarm.train.data import BUILTIN_CORPORA, load_corpus
from swarm.train.loop import TrainConfig, train


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
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
    type=int,
    default=TrainConfig.steps,
    help="Total optimiser steps (a resumed run continues up to this number).",
)
@click.option("--batch-size", type=int, default=TrainConfig.batch_size, help="Sequences per step.")
@click.option("--seq-len", type=int, default=TrainConfig.seq_len, help="Tokens per training sequence (including BOS).")
@click.option(
    "--lr",
    type=float,
    default=TrainConfig.lr,
    help="Peak learning rate (linear warm-up, cosine decay to 10%).",
)
@click.option("--warmup", type=int, default=TrainConfig.warmup, help="Warm-up steps.")
@click.option("--hidden-size", type=int, default=TrainConfig.hidden_size, help="Model width.")
@click.option("--layers", type=int, default=TrainConfig.layers, help="Number of transformer blocks.")
@click.option("--heads", type=int, default=TrainConfig.heads, help="Attention heads.")
@click.option("--kv-heads", type=int, default=TrainConfig.kv_heads, help="Key/value heads (grouped-query attention).")
@click.option("--intermediate-size", type=int, default=TrainConfig.intermediate_size, help="SwiGLU hidden width.")
@click.option(
    "--seed",
    type=int,
    default=TrainConfig.seed,
    help="Seed of initialisation and data order: the same seed gives the same run.",
)
@click.option("--save-every", type=int, default=TrainConfig.save_every, help="Write a checkpoint every N steps.")
@click.option(
    "--save-dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default=TrainConfig.save_dtype,
    help="dtype of the saved weights (training itself is float32).",
)
@click.option("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice).")
def main(data_files: tuple[str, ...], **options) -> None:
    """Train a masked-diffusion LM with the byte tokenizer and write a native checkpoint."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = TrainConfig(data_files=data_files, **options)
    corpus = load_corpus(cfg.corpus, data_files)
    path = train(cfg, corpus)
    click.echo(f"checkpoint written to {path}")


if __name__ == "__main__":
    main()
