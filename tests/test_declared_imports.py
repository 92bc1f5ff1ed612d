"""Every third-party package the project imports is declared in setup.cfg (issue 46).

A fresh environment installs only what is declared: a test module that imported ``hypothesis`` without the test extra
declaring it passed on the machine that happened to have it and did not even collect on a new one. Each file's imports
must be installable the way its readers install the project:

* ``swarm/``: ``install_requires``, or an extra that the importing code's package documents in its docstring
  (``pip install -e ".[api]"`` in ``swarm/api/__init__.py``);
* ``tests/``: ``install_requires`` and the test extra (the README's test command installs ``.[test]``);
* ``benchmarks/`` and ``examples/``: ``install_requires`` and any extra.
"""
from __future__ import annotations

import ast
import configparser
import functools
import importlib.metadata
import re
import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.source_trees import parse_source

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("swarm", "tests", "benchmarks", "examples")
# Modules a test writes itself and imports from its tmp_path: not a package anyone installs.
MADE_BY_TESTS = {"deferpkg": "tests/test_lazy_imports.py builds it in tmp_path"}


def declared_groups() -> dict[str, set[str]]:
    """``install_requires`` (as "") and each extra: their distributions' canonical names."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    texts = {"": config["options"]["install_requires"]}
    texts.update(config["options.extras_require"])
    return {group: {canonicalize_name(Requirement(line).name) for line in text.splitlines()
                    if line.strip() and not line.strip().startswith("#")} for group, text in texts.items()}


def local_modules() -> set[str]:
    """Top-level names that are the project's own: its folders, and modules beside a script or test."""
    names = {path.name for path in ROOT.iterdir() if path.is_dir()} | {path.stem for path in ROOT.glob("*.py")}
    for folder in FOLDERS:
        names |= {path.stem for path in (ROOT / folder).rglob("*.py")}
    return names


def imports_of(path: Path) -> Iterator[str]:
    """The top-level module of every absolute import in ``path`` (function-local and guarded ones included)."""
    for node in ast.walk(parse_source(path)):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0]


def documented_extras(path: Path) -> set[str]:
    """Extras named as ``.[EXTRA]`` in the docstring of ``path``'s module or of a package above it in swarm/."""
    extras: set[str] = set()
    for candidate in [path, *[parent / "__init__.py" for parent in path.parents if ROOT / "swarm" in [parent,
                                                                                                       *parent.parents]]]:
        if candidate.is_file():
            docstring = ast.get_docstring(parse_source(candidate)) or ""
            extras |= set(re.findall(r'\.\[(\w+)\]', docstring))
    return extras


def allowed_groups(path: Path, folder: str, groups: dict[str, set[str]]) -> set[str]:
    """The groups a file in ``folder`` (one of :data:`FOLDERS`) may import from."""
    if folder == "swarm":
        return {""} | documented_extras(path)
    if folder == "tests":
        return {"", "test"}
    return set(groups)


@functools.lru_cache(maxsize=1)
def module_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distributions_of(module: str) -> Optional[set[str]]:
    found = module_distributions().get(module)
    return {canonicalize_name(name) for name in found} if found else None


def problems_of(path: Path, folder: str, groups: dict[str, set[str]], local: set[str]) -> list[str]:
    """One line per module ``path`` imports that no group it may use declares."""
    problems = []
    allowed_names = allowed_groups(path, folder, groups)
    allowed = set().union(*(groups[group] for group in allowed_names))
    for module in sorted(set(imports_of(path))):
        if module in sys.stdlib_module_names or module in local or module in MADE_BY_TESTS:
            continue
        distributions = distributions_of(module)
        if distributions is None and canonicalize_name(module) in allowed:
            continue  # declared under its own name in an extra this environment did not install
        if distributions is None:
            problems.append(f"{path}: {module} is not installed here, so its package cannot be checked (install the "
                            "project's extras, or declare it)")
        elif not distributions & allowed:
            where = ", ".join(sorted(group or "install_requires" for group in allowed_names))
            problems.append(f"{path}: {module} ({' or '.join(sorted(distributions))}) is not declared where this "
                            f"file may take it from ({where})")
    return problems


def all_problems() -> list[str]:
    groups, local = declared_groups(), local_modules()
    return [problem for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
            for problem in problems_of(path, folder, groups, local)]


@pytest.mark.unit
def test_every_third_party_import_is_declared_where_its_readers_install_it():
    problems = all_problems()
    assert not problems, "\n".join(problems)


@pytest.mark.unit
def test_the_check_refuses_an_undeclared_import_and_one_from_the_wrong_extra(tmp_path):
    """The walk above would pass vacuously if it missed imports: files that must fail, and must not."""
    groups, local = declared_groups(), local_modules()
    library = tmp_path / "library.py"
    library.write_text("import torch\n\ndef check():\n    import hypothesis\n")
    assert problems_of(library, "swarm", groups, local) == [
        f"{library}: hypothesis (hypothesis) is not declared where this file may take it from (install_requires)"]
    assert problems_of(library, "tests", groups, local) == [], "the test extra declares hypothesis"
    missing = tmp_path / "test_missing.py"
    missing.write_text("from surely_not_a_package_here.sub import thing\n")
    assert "surely_not_a_package_here is not installed here" in problems_of(missing, "tests", groups, local)[0]
    api_app = ROOT / "swarm" / "api" / "app.py"
    assert allowed_groups(api_app, "swarm", groups) == {"", "api"}, "swarm/api/__init__.py documents .[api]"
    assert allowed_groups(ROOT / "swarm" / "client" / "model.py", "swarm", groups) == {""}
