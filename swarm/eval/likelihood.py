"""Held-out masked-token accuracy and LLaDA's likelihood bound, per token and per byte of text.

The bound is the training objective evaluated on data the model never saw: for each row, the expectation
over the masking rate t of the 1/t-weighted cross-entropy of the masked tokens upper-bounds the row's
negative log-likelihood (LLaDA, eq. 3). The expectation is estimated with stratified draws of t (one per
stratum of (0, 1]) so a handful of draws already gives a steady figure. On a task corpus the prompt is
given, as in training, so the bound is on -log p(answer and padding | prompt).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from tqdm.auto import tqdm

from swarm.models.modules import DiffusionTransformer
from swarm.models.tokenizer import ByteTokenizer, Tokenizer
from swarm.train.data import Corpus, padding_mask
from swarm.train.objective import EPS, mask_tokens, masked_cross_entropy

Logits = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
BYTE_IDS = 256  # ids below this are UTF-8 bytes in the byte tokenizer


def text_bytes(tokenizer: Tokenizer, rows: torch.Tensor, scored: torch.Tensor) -> int:
    """UTF-8 bytes of the text at the scored positions (specials such as EOS padding excluded).

    Per byte of text is the unit in which models with different tokenizers can be compared.
    """
    if isinstance(tokenizer, ByteTokenizer):
        return int(((rows < BYTE_IDS) & scored).sum())
    return sum(len(tokenizer.decode(row[keep].tolist()).encode("utf-8")) for row, keep in zip(rows, scored))


@dataclass
class LikelihoodReport:
    corpus: str
    examples: int  # held-out rows
    seq_len: int  # tokens per row, BOS included (BOS, and a task's prompt, are given, never scored)
    t_draws: int  # masking rates drawn per row
    masked_tokens: int  # positions scored for accuracy, over all draws
    masked_accuracy: float  # argmax prediction == true token, over masked positions with t ~ U(0, 1)
    nats_per_token: float  # likelihood bound per scored token
    # the same bound in bits per scored UTF-8 byte (specials such as EOS padding cost, but do not count)
    bits_per_byte: float
    elapsed_s: float


def stratified_rates(rows: int, draw: int, draws: int, generator: torch.Generator) -> torch.Tensor:
    """One masking rate per row inside stratum ``draw`` of ``draws`` equal strata of (eps, 1]."""
    u = torch.rand(rows, generator=generator)
    return EPS + (1 - EPS) * (draw + u) / draws


@torch.inference_mode()
def evaluate_likelihood(
    model: DiffusionTransformer, corpus: Corpus, *, examples: int = 256, seq_len: int = 128, t_draws: int = 8,
    seed: int = 0, batch_size: int = 64, progress: bool = False, forward: Optional[Logits] = None,
) -> LikelihoodReport:
    """Score ``examples`` held-out rows of ``corpus``; the rows and the noise depend only on ``seed``.

    ``forward(tokens, attention_mask)`` gives the logits scored (default: ``model``'s); an adapted model's
    (``DiffusionLM.logits`` with an adapter) is scored on the same rows and noise as its base."""
    forward = forward or model
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    rows = corpus.batch(examples, seq_len, generator, held_out=True)
    mask_id = model.config.mask_token_id
    nats, correct, masked_total = 0.0, 0, 0
    chunks = rows.split(batch_size)
    with tqdm(total=t_draws * len(chunks), desc=f"held-out {corpus.name}", leave=False, disable=not progress) as bar:
        for draw in range(t_draws):
            for chunk in chunks:
                t = stratified_rates(len(chunk), draw, t_draws, generator)
                noisy, masked, t = mask_tokens(chunk, mask_id, generator, t=t, given=corpus.given_positions(chunk))
                logits = forward(noisy, padding_mask(chunk, model.config.pad_token_id)).float()
                nats += masked_cross_entropy(logits, chunk, masked, t).sum().item()
                logits[..., mask_id] = float("-inf")  # as the sampler does: a prediction is never the mask
                correct += int(((logits.argmax(-1) == chunk) & masked).sum())
                masked_total += int(masked.sum())
                bar.update()
    nats_per_draw = nats / t_draws
    scored = ~corpus.given_positions(rows)
    return LikelihoodReport(
        corpus=corpus.name, examples=examples, seq_len=seq_len, t_draws=t_draws, masked_tokens=masked_total,
        masked_accuracy=correct / max(1, masked_total),
        nats_per_token=nats_per_draw / int(scored.sum()),
        bits_per_byte=nats_per_draw / max(1, text_bytes(corpus.tokenizer, rows, scored)) / math.log(2),
        elapsed_s=time.perf_counter() - started,
    )
