"""Counted nouns for lines people read: ``1 server announced``, not ``1 servers announced``."""
from __future__ import annotations

from typing import Optional, Sequence


def noun_for(count: int, noun: str, many: Optional[str] = None) -> str:
    """``noun``, in the plural unless ``count`` is 1 (``many`` when adding an s is wrong)."""
    return noun if count == 1 else many or noun + "s"


def plural(count: int, noun: str, many: Optional[str] = None) -> str:
    """``count`` and ``noun``, in the plural unless ``count`` is 1 (``many`` when adding an s is wrong)."""
    return f"{count} {noun_for(count, noun, many)}"


def listed(noun: str, items: Sequence[str], many: Optional[str] = None) -> str:
    """``noun`` and the ``items`` it names, separated by commas, the noun in the plural unless there is one item:
    ``option orphan``, ``options a, b`` (where a line names what it counts instead of giving the count)."""
    return f"{noun_for(len(items), noun, many)} {', '.join(items)}"
