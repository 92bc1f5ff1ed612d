"""``python -m swarm.train.tokenizer``: train the byte-level BPE vocabulary of the project's own models.

The vocabulary is learnt from the training parts of the prose and Python corpora only (never their
held-out tails), so the backbone and the experts that are composed with it share one tokenizer. Digits
are split one per token: an addition expert then sees the same digits whatever number they stand in.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

import click

from swarm.cli.options import SwarmCommand, run_main, setup_logging
from swarm.models.tokenizer import SubwordTokenizer

logger = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 4096
MIN_FREQUENCY = 2


def train_subword_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> SubwordTokenizer:
    """A byte-level BPE tokenizer learnt from ``texts``; its first ids are :attr:`SubwordTokenizer.SPECIAL_TOKENS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SubwordTokenizer.SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} cannot hold the 256 bytes and the special tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=MIN_FREQUENCY, special_tokens=list(SubwordTokenizer.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return SubwordTokenizer(tokenizer)


def training_texts(python_share: float = 0.25) -> list[str]:
    """The training parts of the prose sources, and Python sources up to ``python_share`` of the prose."""
    from swarm.train.data import held_out_split, python_bytes
    from swarm.train.prose import prose_sources

    prose = [held_out_split(text)[0] for text in prose_sources()]
    python_text = held_out_split(python_bytes().decode("utf-8", errors="ignore"))[0]
    python_chars = int(python_share * sum(map(len, prose)))
    return prose + [python_text[:python_chars]]


@click.command(cls=SwarmCommand, context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--output", required=True, type=click.Path(file_okay=False),
              help="Directory to write tokenizer.json into (created).")
@click.option("--vocab-size", type=click.IntRange(min=260), default=DEFAULT_VOCAB_SIZE,
              help="Number of ids, the 4 special tokens and 256 bytes included.")
def main(output: str, vocab_size: int) -> None:
    """Learn the subword vocabulary from the training parts of the prose and Python corpora."""
    setup_logging(logging.INFO)
    texts = training_texts()
    logger.info("learning %d ids from %d texts, %.1f MB", vocab_size, len(texts), sum(map(len, texts)) / 1e6)
    tokenizer = train_subword_tokenizer(texts, vocab_size)
    Path(output).mkdir(parents=True, exist_ok=True)
    path = tokenizer.save(output)
    click.echo(f"tokenizer with {tokenizer.vocab_size} ids written to {path} ({tokenizer.fingerprint()})")


if __name__ == "__main__":
    run_main(main)
