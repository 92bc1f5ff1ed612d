"""Counted nouns for lines people read: ``1 server announced``, not ``1 servers announced``."""
from __future__ import annotations

from typing import Optional


def plural(count: int, noun: str, many: Optional[str] = None) -> str:
    """``count`` and ``noun``, in the plural unless ``count`` is 1 (``many`` when adding an s is wrong)."""
    return f"{count} {noun if count == 1 else many or noun + 's'}"
