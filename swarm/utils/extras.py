"""Which optional extra of the package provides a missing module, and the one spelling of the line that installs it.

The README installs the project with ``pip install -e .`` (every command it names works after that); a few parts need
more (the improvement demo's plot, the prose corpus, a ``datasets`` source). When one of those is missing, the command
says which extra to install, in one line and with exit 2, instead of reporting an unexpected error. The extras are
read from the installed package's metadata (setup.cfg's ``extras_require``), so that this module lists none itself.
"""
from __future__ import annotations

import functools
import importlib.metadata
import re
from typing import Optional

DISTRIBUTION = "diffusion-swarm"
TEST_EXTRA = "test"  # holds a copy of every package the tests import: never the extra to advise


def install_hint(extra: str) -> str:
    """The install line of ``extra``, spelled as the README spells its own (``pip install -e ".[test]"``)."""
    return f'pip install -e ".[{extra}]"'


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.lru_cache(maxsize=1)
def extras_of_packages() -> dict[str, str]:
    """``{canonical distribution name: extra}`` for every optional package (the test extra only when no other)."""
    try:
        lines = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return {}
    found: dict[str, str] = {}
    for line in lines:
        match = re.match(r"\s*([A-Za-z0-9_.\-]+).*;\s*extra\s*==\s*['\"]([^'\"]+)['\"]", line)
        if match:
            name, extra = _canonical(match.group(1)), match.group(2)
            if name not in found or found[name] == TEST_EXTRA:
                found[name] = extra
    return found


def extra_providing(module: Optional[str]) -> Optional[str]:
    """The extra whose package provides top-level ``module`` (``matplotlib`` -> ``plot``); None if no extra does."""
    if not module:
        return None
    return extras_of_packages().get(_canonical(module.split(".")[0]))


def missing_extra_message(error: ImportError) -> Optional[str]:
    """One line naming the extra to install for a ``ModuleNotFoundError`` of an optional package; None otherwise."""
    if not isinstance(error, ModuleNotFoundError):
        return None
    module = (error.name or "").split(".")[0]
    extra = extra_providing(module)
    if extra is None:
        return None
    return f"this needs the package '{module}', which the {extra} extra installs: {install_hint(extra)}"
