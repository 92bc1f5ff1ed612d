"""Package attributes imported on first use, so that importing a package (``swarm``, ``swarm.client``) for one
light module does not load torch, hivemind or transformers (a command's ``--help`` answers at once); and
:func:`defer_import`, for a dependency's module that is imported at start but seldom used."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for a package whose public ``name`` lives in module ``exports[name]``."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__


def defer_import(name: str) -> None:
    """Make the first ``import NAME`` create the module without running its code, which runs on first attribute use
    (:class:`importlib.util.LazyLoader`). A no-op when NAME is imported already.

    Why: hivemind imports ``scipy.optimize`` at its own import (``hivemind.averaging.load_balancing``, for one
    function of the averager that only collaborative fine-tuning calls), about 0.3 s of every server's and
    client's start. Deferred, a process that never averages never loads it. Works for a module imported by one
    ``import`` statement before its first use (a second ``import NAME`` of the unloaded module asks for its
    ``__spec__``, which loads it: harmless, only not deferred). Python 3.11's lazy module is not thread-safe on its
    first attribute use, so defer only a module that is first used by one thread at a time.
    """
    if name in sys.modules or any(getattr(finder, "deferred", None) == name for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferringFinder(name))


class _DeferringFinder(importlib.abc.MetaPathFinder):
    """Finds ``deferred`` where the import system would, and hands it out with a lazy loader."""

    def __init__(self, deferred: str):
        self.deferred = deferred

    def find_spec(self, fullname, path, target=None):
        if fullname != self.deferred:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = importlib.util.LazyLoader(spec.loader)
        return spec
