"""Choosing experts from the prompt (``experts="auto"``): fixed regular-expression rules, no model."""
from __future__ import annotations

import re
from typing import Any

from swarm.diffusion.mixture import validate_weights

ARITHMETIC = re.compile(r"\d+\s*[-+*/x×]\s*\d+")
PYTHON = re.compile(
    r"^\s*(def\s+\w+\s*\(|class\s+\w+\s*[:(]|import\s+\w|from\s+[\w.]+\s+import\b|return\b|"
    r"(if|elif|for|while|with|try|except)\b.*:\s*$)|\bprint\(|\bself\.",
    re.MULTILINE,
)
AUTO_RULES: tuple[tuple[str, re.Pattern, float], ...] = (
    ("addition", ARITHMETIC, 1.0),  # a narrow task expert: let it lead (clipping still bounds it)
    # At 0.5 the prose backbone won every code prompt (0/8 code-shaped completions, docs/MODEL_CARD.md); at 1.0 the
    # expert leads, with clipping still bounding it.
    ("code", PYTHON, 1.0),
)


def auto_experts(prompt: str) -> dict[str, float]:
    """Experts and weights for ``experts="auto"``: every rule of :data:`AUTO_RULES` whose pattern occurs.

    An arithmetic pattern (``12+34``, ``3 * 4``) selects ``addition`` at weight 1.0; Python syntax (a line
    starting ``def f(``, ``class C:``, ``import x``, ``from x import``, ``return``, a compound statement
    ending in ``:``, or ``print(`` / ``self.`` anywhere) selects ``code`` at 1.0. No match: no expert.
    """
    return {name: weight for name, pattern, weight in AUTO_RULES if pattern.search(prompt)}


def expert_weights(experts: Any, prompt: str) -> tuple[dict[str, float], bool]:
    """Resolve the ``experts`` argument: ``None``, ``"auto"`` or ``{name: weight}``; says whether it was auto."""
    if experts is None:
        return {}, False
    if isinstance(experts, str):
        if experts != "auto":
            raise ValueError(f"experts must be 'auto' or a mapping of name to weight, got {experts!r}")
        return auto_experts(prompt), True
    return validate_weights(experts), False
