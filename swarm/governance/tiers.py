"""Safety tiers: classify each request as public, internal or restricted, and the policy of each tier.

The rules are an ordered list of (tier, regular expression) pairs matched against the prompt; the strictest
matching tier wins. A user may ask for a stricter tier than the rules give, never a looser one. Operators
replace the defaults with a JSON file: ``{"rules": [{"tier": "restricted", "pattern": "..."}],
"policies": {"internal": {"spot_check_fraction": 0.5}}}``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

TIERS = ("public", "internal", "restricted")  # from loosest to strictest

DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    ("restricted", r"\b(password|passwd|secret key|private key|api[ _-]?key|social security|ssn|credit card|iban)\b"),
    ("restricted", r"\b\d{3}-\d{2}-\d{4}\b"),  # US social security number shape
    ("internal", r"\b(confidential|internal only|do not distribute|proprietary|nda)\b"),
)


@dataclass(frozen=True)
class TierPolicy:
    """What a tier requires of the servers that handle it."""

    spot_check_fraction: float  # share of span computations re-executed on a second server
    trusted_only: bool  # only peers on the client's allow-list may serve it
    require_verified: bool = False  # an unresolved spot check stops the generation instead of going on


DEFAULT_POLICIES = {
    "public": TierPolicy(spot_check_fraction=0.0, trusted_only=False),
    "internal": TierPolicy(spot_check_fraction=0.25, trusted_only=False),
    "restricted": TierPolicy(spot_check_fraction=1.0, trusted_only=True, require_verified=True),
}


def stricter(a: str, b: str) -> str:
    return a if TIERS.index(a) >= TIERS.index(b) else b


@dataclass
class TierRules:
    rules: list[tuple[str, re.Pattern]] = field(
        default_factory=lambda: [(tier, re.compile(p, re.IGNORECASE)) for tier, p in DEFAULT_RULES])
    policies: dict[str, TierPolicy] = field(default_factory=lambda: dict(DEFAULT_POLICIES))

    @classmethod
    def from_file(cls, path: str | Path) -> "TierRules":
        data = json.loads(Path(path).read_text())
        rules = cls()
        if "rules" in data:
            rules.rules = [(check_tier(r["tier"]), re.compile(r["pattern"], re.IGNORECASE)) for r in data["rules"]]
        for tier, changes in data.get("policies", {}).items():
            rules.policies[check_tier(tier)] = replace(rules.policies[tier], **changes)
        return rules

    def classify(self, prompt: str, requested: Optional[str] = None) -> str:
        """The strictest of the matching rules' tiers and the tier the user asked for."""
        tier = "public"
        for rule_tier, pattern in self.rules:
            if pattern.search(prompt):
                tier = stricter(tier, rule_tier)
        return stricter(tier, check_tier(requested)) if requested else tier


def check_tier(tier: str) -> str:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; choose one of {', '.join(TIERS)}")
    return tier
