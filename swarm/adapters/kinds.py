"""The adapter kinds' names, defined once: adapter files, requests, server records and the CLI all use these.

A *soft prompt* adds positions before the sequence and nothing per block; the three *per-block* kinds carry one
``(blocks, R, hidden)`` tensor whose block i slice acts at block i (:mod:`swarm.adapters.block`): a deep prompt's
vectors, a bottleneck's weights, a LoRA's packed matrices. Bottlenecks and LoRAs are sized by a rank and add no
positions; the prompt kinds are sized by their number of vectors. Their bounds are here too, plain values that
``python -m swarm.finetune --help`` declares without loading torch.
"""
from __future__ import annotations

SOFT_PROMPT = "soft_prompt"
DEEP_PROMPT = "deep_prompt"
BOTTLENECK = "bottleneck"
LORA = "lora"
KINDS = (SOFT_PROMPT, DEEP_PROMPT, BOTTLENECK, LORA)
PER_BLOCK_KINDS = (DEEP_PROMPT, BOTTLENECK, LORA)  # a tensor slice per block, carried by every request
RANKED_KINDS = (BOTTLENECK, LORA)  # sized by a rank and adding no positions; the prompt kinds by their vectors
MAX_PROMPT_LENGTH = 256  # rows of one block's tensor (prompt vectors, or a bottleneck's 2 x rank)
MAX_RANK = MAX_PROMPT_LENGTH // 2


def described(kind: str) -> str:
    """The kind as words, for messages: ``deep prompt``."""
    return kind.replace("_", " ")


def size_setting(kind: str) -> str:
    """The setting that sizes an adapter of ``kind``: a bottleneck's or LoRA's ``rank``, a prompt's
    ``prompt_length``."""
    return "rank" if kind in RANKED_KINDS else "prompt_length"
