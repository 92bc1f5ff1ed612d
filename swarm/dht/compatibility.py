"""The compatibility tag of a model: what an expert announces in its DHT record and a client compares.

It lives with the DHT schema because it is part of a record (``ExpertRecord.tag``); it needs no torch, so the
schema, the servers and the clients read it without importing the sampler.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class IncompatibleExpertError(ValueError):
    """An expert that does not share the backbone's tokenizer, vocabulary or mask token."""


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
        """Raises ValueError/TypeError/KeyError on anything malformed (callers treat it as a bad record)."""
        return cls(str(value["tokenizer"]), int(value["vocab_size"]), int(value["mask_token_id"]))

    def mismatches(self, other: "CompatibilityTag") -> list[str]:
        """Human-readable differences, empty when compatible."""
        return [f"{name} {getattr(other, name)!r} (backbone: {getattr(self, name)!r})"
                for name in ("tokenizer", "vocab_size", "mask_token_id") if getattr(self, name) != getattr(other, name)]

    def require_compatible(self, other: "CompatibilityTag", expert: str) -> None:
        problems = self.mismatches(other)
        if problems:
            raise IncompatibleExpertError(f"expert {expert!r} is incompatible with the backbone: {'; '.join(problems)}")
