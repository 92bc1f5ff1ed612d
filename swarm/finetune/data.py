"""Prompt/response pairs for supervised fine-tuning, laid out as LLaDA's SFT rows.

A row is ``[BOS] prompt response [EOS]`` padded with EOS to the longest row of its batch: the prompt is given
(never masked), and the response with its EOS padding is what the model learns to fill in, as a generation
asks of it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

MAX_EXAMPLE_TOKENS = 4096
MAX_DATA_BYTES = 512 * 2**20


@dataclass(frozen=True)
class Example:
    prompt: list[int]  # [BOS] + prompt ids
    response: list[int]  # response ids + [EOS]


@dataclass(frozen=True)
class SFTBatch:
    tokens: torch.Tensor  # (batch, length)
    given: torch.Tensor  # (batch, length) bool: BOS and the prompt, never masked
    answer_lengths: torch.Tensor  # (batch,) positions each row learns (response and EOS padding)


def load_examples(path: str | Path, tokenizer: Any, eos_token_id: int) -> list[Example]:
    """Every ``{"prompt": ..., "response": ...}`` line of a JSONL file; ValueError names a bad line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--data {path}: no such file")
    if path.stat().st_size > MAX_DATA_BYTES:
        raise ValueError(f"--data {path} has {path.stat().st_size} bytes, over the limit of {MAX_DATA_BYTES}")
    bos = tokenizer.bos_token_id
    examples = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not valid JSON ({error})") from None
        if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("prompt", "response")):
            raise ValueError(f"{path}:{number}: each line must be an object with string 'prompt' and 'response'")
        if not record["prompt"] or not record["response"]:
            raise ValueError(f"{path}:{number}: empty prompt or response")
        example = Example(([bos] if bos is not None else []) + tokenizer.encode(record["prompt"]),
                          tokenizer.encode(record["response"]) + [eos_token_id])
        if len(example.prompt) + len(example.response) > MAX_EXAMPLE_TOKENS:
            raise ValueError(f"{path}:{number}: over {MAX_EXAMPLE_TOKENS} tokens")
        examples.append(example)
    if not examples:
        raise ValueError(f"--data {path} holds no examples")
    return examples


def data_digest(path: str | Path) -> str:
    """sha256 of the data file: a resumed run checks it trains on the same data."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def make_batch(examples: Sequence[Example], eos_token_id: int, pad_response: int = 0) -> SFTBatch:
    """Rows padded with EOS to the longest (and every response to at least ``pad_response`` tokens, so that the
    model learns where an answer ends at the length it will generate); the prompt positions are given."""
    length = max(len(e.prompt) + max(len(e.response), pad_response) for e in examples)
    tokens = torch.full((len(examples), length), eos_token_id, dtype=torch.long)
    given = torch.zeros(len(examples), length, dtype=torch.bool)
    for row, example in enumerate(examples):
        ids = example.prompt + example.response
        tokens[row, :len(ids)] = torch.tensor(ids)
        given[row, :len(example.prompt)] = True
    return SFTBatch(tokens, given, (~given).sum(1).clamp(min=1))
