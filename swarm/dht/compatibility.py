"""The compatibility tag of a model: what an expert announces in its DHT record and a client compares.

It lives with the DHT schema because it is part of a record (``ExpertRecord.tag``); it needs no torch, so the
schema, the servers and the clients read it without importing the sampler.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarm.utils import fields
from swarm.utils.errors import EXIT_USAGE, SwarmError

MAX_TOKENIZER_CHARS, MAX_VOCAB = 128, 2**31

class IncompatibleExpertError(SwarmError, ValueError):
    """An expert that does not share the backbone's tokenizer, vocabulary or mask token."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class CompatibilityTag:
    """What two models must share for their per-token log-probabilities to be comparable."""

    tokenizer: str  # the tokenizer's fingerprint
    vocab_size: int
    mask_token_id: int

    @classmethod
    def of(cls, config: Any, tokenizer: Any) -> "CompatibilityTag":
        """The tag of a model from its config (vocab size, mask id) and its tokenizer."""
        return cls(tokenizer.fingerprint(), int(config.vocab_size), int(config.mask_token_id))

    def to_value(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer, "vocab_size": self.vocab_size, "mask_token_id": self.mask_token_id}

    @classmethod
    def from_value(cls, value: Any) -> "CompatibilityTag":
        """Every field bounded; raises ValueError on anything malformed (callers treat it as a bad record)."""
        if not isinstance(value, dict):
            raise ValueError("a compatibility tag is a map")
        return cls(fields.text(value.get("tokenizer"), MAX_TOKENIZER_CHARS),
                   fields.integer(value.get("vocab_size"), 1, MAX_VOCAB),
                   fields.integer(value.get("mask_token_id"), 0, MAX_VOCAB))

    def mismatches(self, other: "CompatibilityTag") -> list[str]:
        """Human-readable differences, empty when compatible."""
        return [f"{name} {getattr(other, name)!r} (backbone: {getattr(self, name)!r})"
                for name in ("tokenizer", "vocab_size", "mask_token_id") if getattr(self, name) != getattr(other, name)]

    def require_compatible(self, other: "CompatibilityTag", expert: str) -> None:
        problems = self.mismatches(other)
        if problems:
            raise IncompatibleExpertError(f"expert {expert!r} is incompatible with the backbone: {'; '.join(problems)}")
