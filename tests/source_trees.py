"""Parsing the project's own source for tests that read it (imports, exception classes, DHT keys, layers).

CPython 3.11 keeps one recursion counter per interpreter while it turns a parsed tree into Python objects, so an
``ast.parse`` racing another thread's (a thread a previous test left running in the same xdist worker, or an
import that pytest rewrites) raises ``SystemError: AST constructor recursion depth mismatch`` (CPython issue
gh-106905, fixed in 3.12). The tree itself is fine: parsing again gives it.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Union

ATTEMPTS = 5


def parse_source(source: Union[str, Path], filename: str = "<unknown>") -> ast.Module:
    """``ast.parse`` of a file (a Path) or of source text, parsed again when the interpreter's race hits it."""
    if isinstance(source, Path):
        source, filename = source.read_text(), str(source)
    for _ in range(ATTEMPTS - 1):
        try:
            return ast.parse(source, filename)
        except SystemError as error:
            if "recursion depth mismatch" not in str(error):
                raise
    return ast.parse(source, filename)
