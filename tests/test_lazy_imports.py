"""Imports deferred to first use (:func:`swarm.utils.lazy.defer_import`): the module's code runs when it is first
used, not when it is imported, and then works as if imported eagerly."""
from __future__ import annotations

import importlib
import sys
import types

import pytest

from swarm.utils.lazy import defer_import


@pytest.fixture
def package(tmp_path, monkeypatch):
    """``deferpkg`` with a submodule ``heavy`` that counts its runs in the package, importable from ``tmp_path``; the
    finders and modules a test adds are gone afterwards."""
    root = tmp_path / "deferpkg"
    root.mkdir()
    (root / "__init__.py").write_text("runs = 0\n")
    (root / "heavy.py").write_text("import deferpkg\ndeferpkg.runs += 1\n\ndef answer():\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    yield "deferpkg"
    for name in [name for name in sys.modules if name == "deferpkg" or name.startswith("deferpkg.")]:
        del sys.modules[name]


def test_a_deferred_module_runs_on_first_use_not_at_import(package):
    defer_import("deferpkg.heavy")
    import deferpkg.heavy  # the package the fixture wrote in tmp_path, not a dependency to declare

    assert deferpkg.runs == 0, "importing it ran none of its code"
    assert sys.modules["deferpkg.heavy"] is deferpkg.heavy, "and it is the package's attribute, as after any import"
    assert deferpkg.heavy.answer() == 42
    assert deferpkg.runs == 1
    assert type(deferpkg.heavy) is types.ModuleType, "once used, an ordinary module"
    assert importlib.import_module("deferpkg.heavy").answer() == 42 and deferpkg.runs == 1, "it ran once"


def test_deferring_twice_or_an_imported_module_adds_no_finder(package):
    finders = len(sys.meta_path)
    defer_import("deferpkg.heavy")
    defer_import("deferpkg.heavy")
    assert len(sys.meta_path) == finders + 1, "one finder for one module"
    defer_import("json")  # imported already: nothing to do
    assert len(sys.meta_path) == finders + 1


def test_scipy_optimize_deferred_by_swarm_still_solves_hivemind_load_balancing():
    import swarm  # noqa: F401  (defers scipy.optimize, before hivemind imports it)

    # conftest imports swarm before any test imports hivemind, so swarm's deferral is in place in this process
    assert any(getattr(finder, "deferred", None) == "scipy.optimize" for finder in sys.meta_path)
    import scipy.optimize
    from hivemind.averaging.load_balancing import load_balance_peers

    assert callable(scipy.optimize.linprog)
    assert type(sys.modules["scipy.optimize"]) is types.ModuleType, "loaded now"
    result = scipy.optimize.linprog([1.0, 1.0], A_ub=[[-1.0, -1.0]], b_ub=[-1.0], bounds=[(0, None), (0, None)])
    assert result.success and result.fun == pytest.approx(1.0)
    parts = load_balance_peers(100, (1.0, 2.0, 3.0))
    assert len(parts) == 3 and sum(parts) == 100 and parts[2] >= parts[1] >= parts[0], parts
    assert sum(load_balance_peers(100, (1.0, 2.0, None), min_size=10)) == 100
