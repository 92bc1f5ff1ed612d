"""Strict fields of records read from the DHT: every parser of a remote record builds on these.

A record is remote input even when its signature holds (its signer may be the attacker). Each helper accepts
exactly one shape, bounded (finite numbers in a range, integers in a range, texts cut, lists and maps capped,
scalar values only), and raises ValueError for anything else; a record parser catches every exception at its
boundary and returns None, so no record can make a reader raise.
"""
from __future__ import annotations

import math
from typing import Any, Optional

MAX_SAFE_INT = 2**53  # what every JSON reader keeps exactly
Scalar = str | int | float | bool | None


def record_body(payload: Any, max_bytes: int, version: int, max_keys: int, what: str) -> dict:
    """The map a signed msgpack record holds: ``payload`` at most ``max_bytes``, decoding to a map of at most
    ``max_keys`` fields whose ``record_version`` is ``version``; ValueError naming ``what`` otherwise."""
    from hivemind.utils import MSGPackSerializer  # hivemind's msgpack settings, as the writers use

    if not isinstance(payload, bytes) or len(payload) > max_bytes:
        raise ValueError(f"{what} is at most {max_bytes} bytes")
    try:
        body = MSGPackSerializer.loads(payload)
    except Exception as error:  # msgpack raises many types on junk
        raise ValueError(f"not msgpack: {type(error).__name__}") from None
    if not isinstance(body, dict) or len(body) > max_keys or body.get("record_version") != version:
        raise ValueError(f"{what} of an unknown format or version")
    return body


def integer(raw: Any, low: int = 0, high: int = MAX_SAFE_INT) -> int:
    """An int (not a bool, not a float) within [low, high]."""
    if not isinstance(raw, int) or isinstance(raw, bool) or not low <= raw <= high:
        raise ValueError(f"expected an integer in [{low}, {high}], got {_show(raw)}")
    return raw


def number(raw: Any, low: float = 0.0, high: float = 1e12) -> float:
    """A finite int or float (not a bool) within [low, high], as a float."""
    if not isinstance(raw, (int, float)) or isinstance(raw, bool) or isinstance(raw, int) and abs(raw) > MAX_SAFE_INT:
        raise ValueError(f"expected a number, got {_show(raw)}")
    value = float(raw)
    if not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"expected a finite number in [{low}, {high}], got {_show(raw)}")
    return value


def text(raw: Any, max_chars: int) -> str:
    """A str (bytes are refused), cut to ``max_chars``; lone surrogates are replaced so it always encodes."""
    if not isinstance(raw, str):
        raise ValueError(f"expected text, got {type(raw).__name__}")
    return raw[:max_chars].encode("utf-8", errors="replace").decode("utf-8")


def optional_text(raw: Any, max_chars: int) -> Optional[str]:
    return None if raw is None else text(raw, max_chars)


def texts(raw: Any, max_items: int, max_chars: int) -> list[str]:
    """A list of at most ``max_items`` texts, each cut to ``max_chars``."""
    if not isinstance(raw, list) or len(raw) > max_items:
        raise ValueError(f"expected a list of at most {max_items} texts")
    return [text(item, max_chars) for item in raw]


def flag(raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise ValueError(f"expected true or false, got {_show(raw)}")
    return raw


def scalar(raw: Any, max_chars: int) -> Scalar:
    """None, a bool, a safe integer, a finite number or a text cut to ``max_chars``."""
    if raw is None or isinstance(raw, bool):
        return raw
    if isinstance(raw, int):
        return integer(raw, -MAX_SAFE_INT, MAX_SAFE_INT)
    if isinstance(raw, float):
        return number(raw, -1e300, 1e300)
    return text(raw, max_chars)


def small_value(raw: Any, max_chars: int, depth: int = 0, max_items: int = 16) -> Any:
    """A scalar, or (with ``depth`` > 0) a list of at most ``max_items`` small values one level shallower."""
    if isinstance(raw, list) and depth > 0:
        if len(raw) > max_items:
            raise ValueError(f"expected a list of at most {max_items} items")
        return [small_value(item, max_chars, depth - 1, max_items) for item in raw]
    return scalar(raw, max_chars)


def scalar_map(raw: Any, max_items: int = 16, max_key_chars: int = 64, max_chars: int = 256,
               list_depth: int = 0) -> dict[str, Any]:
    """A map of at most ``max_items`` text keys to scalar values; with ``list_depth``, values may also be small
    lists nested that deep (e.g. a learning-rate schedule ``[[step, lr], ...]``), never maps."""
    if not isinstance(raw, dict) or len(raw) > max_items:
        raise ValueError(f"expected a map of at most {max_items} entries")
    return {text(key, max_key_chars): small_value(value, max_chars, list_depth) for key, value in raw.items()}


def _show(raw: Any) -> str:
    """A short description of a bad value for a log line (never the whole value)."""
    if isinstance(raw, int) and abs(raw) > MAX_SAFE_INT:
        return "a huge integer"  # str() of a huge int raises (Python's int-to-text digit limit)
    return f"{type(raw).__name__} {str(raw)[:40]!r}" if isinstance(raw, (int, float)) else type(raw).__name__
