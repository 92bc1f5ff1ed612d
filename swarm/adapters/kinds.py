"""The adapter kinds' names, defined once: adapter files, requests, server records and the CLI all use these.

A *soft prompt* adds positions before the sequence and nothing per block; the three *per-block* kinds carry one
``(blocks, R, hidden)`` tensor whose block i slice acts at block i (:mod:`swarm.adapters.block`): a deep prompt's
vectors, a bottleneck's weights, a LoRA's packed matrices. Bottlenecks and LoRAs are sized by a rank and add no
positions; the prompt kinds are sized by their number of vectors.
"""
from __future__ import annotations

SOFT_PROMPT = "soft_prompt"
DEEP_PROMPT = "deep_prompt"
BOTTLENECK = "bottleneck"
LORA = "lora"
KINDS = (SOFT_PROMPT, DEEP_PROMPT, BOTTLENECK, LORA)
PER_BLOCK_KINDS = (DEEP_PROMPT, BOTTLENECK, LORA)  # a tensor slice per block, carried by every request
RANKED_KINDS = (BOTTLENECK, LORA)  # sized by a rank and adding no positions; the prompt kinds by their vectors


def described(kind: str) -> str:
    """The kind as words, for messages: ``deep prompt``."""
    return kind.replace("_", " ")
