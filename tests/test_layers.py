"""Imports point one way (issue 18): the layer table of docs/ARCHITECTURE.md is this test's data.

Every module of the package is parsed with ``ast`` (function-local and ``TYPE_CHECKING`` imports included, since
they are dependencies too). The test fails on a module the table does not place, on an import that goes up the
table, and on any import cycle between modules. The known exceptions are listed below, each with its reason;
an exception that is no longer needed fails too, so the list only shrinks.
"""
from __future__ import annotations

import ast
import functools
import gc
import re
from pathlib import Path
from typing import Iterator, Optional

from tests.source_trees import parse_source

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "swarm"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"

# (importer, imported): why it is still allowed. Empty: every import goes down the table; an entry added here
# must say why the upward import cannot move yet.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def layer_table() -> list[tuple[str, list[str]]]:
    """(layer, module paths) from the ``## Layers`` table, top (entry points) to bottom."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## Layers"):]
    section = section[:section.index("\n## ", 1)]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] in ("layer", "") or set(cells[0]) <= set("-"):
            continue
        paths = [path for path in re.findall(r"`([^`]+)`", cells[1]) if path.startswith("swarm/")]
        rows.append((cells[0], paths))
    return rows


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(path: Path, table: list[tuple[str, list[str]]]) -> Optional[int]:
    """The index of the layer whose most specific path names ``path`` (None when no row does)."""
    relative = path.relative_to(ROOT).as_posix()
    best: Optional[tuple[int, int]] = None  # (length of the matching path, layer index)
    for index, (_, paths) in enumerate(table):
        for entry in paths:
            if relative == entry or (entry.endswith("/") and relative.startswith(entry)):
                if best is None or len(entry) > best[0]:
                    best = (len(entry), index)
    return None if best is None else best[1]


def imported_modules(path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(module, line) for every import of a package module in ``path``, wherever it stands in the file."""
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    for node in ast.walk(parse_source(path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # "import swarm.x.y" names swarm.x.y, or the package holding it
                target = target.rpartition(".")[0]
            if target:
                yield target, node.lineno


@functools.lru_cache(maxsize=1)
def import_graph() -> dict[str, dict[str, int]]:
    """Built once per session, with the garbage collector paused: earlier tests leave objects whose finalizers
    raise (an asyncio loop gone), and CPython 3.11 fails a parse that a collection interrupts with "SystemError:
    AST constructor recursion depth mismatch" (seen once in a full run). One collection first, not one per file:
    after the swarm tests the heap is large and a collection per parsed file cost 40 s per test."""
    known = modules()
    gc.collect()
    gc.disable()
    try:
        return {name: {target: line for target, line in imported_modules(path, known) if target != name}
                for name, path in known.items()}
    finally:
        gc.enable()


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_table_names_real_paths():
    table = layer_table()
    assert [layer for layer, _ in table][:2] == ["entry points", "public API"] and len(table) >= 8
    for layer, paths in table:
        assert paths, f"layer {layer!r} names no module"
        for entry in paths:
            assert (ROOT / entry).exists(), f"layer {layer!r} names {entry}, which does not exist"


def test_every_module_has_a_layer():
    table = layer_table()
    unplaced = [name for name, path in modules().items() if layer_of(path, table) is None]
    assert not unplaced, f"add these modules to the layer table of docs/ARCHITECTURE.md: {unplaced}"


def test_no_import_goes_up_the_table():
    table, known, graph = layer_table(), modules(), import_graph()
    upward, used = [], set()
    for name, targets in graph.items():
        here = layer_of(known[name], table)
        for target, line in targets.items():
            there = layer_of(known[target], table)
            if here is None or there is None or there >= here:
                continue
            if (name, target) in ALLOWED_UPWARD:
                used.add((name, target))
                continue
            upward.append(f"{known[name].relative_to(ROOT)}:{line} ({table[here][0]}) imports {target} "
                          f"({table[there][0]})")
    assert not upward, "imports that go up the layer table:\n" + "\n".join(upward)
    stale = set(ALLOWED_UPWARD) - used
    assert not stale, f"these allowances are no longer needed: remove them from ALLOWED_UPWARD: {sorted(stale)}"


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "modules that import each other (directly or through others): " + "; ".join(
        " <-> ".join(component) for component in found)


def test_no_cycles_between_packages_below_the_entry_points():
    """Packages (``swarm.dht``, ``swarm.client``...) do not import each other in a circle either. Entry points
    that live inside a package (``swarm/dht/__main__.py``) are left out: they sit at the top, whatever their
    folder, and import the shared command-line options (``swarm.cli.options``) like any other command."""
    table, known, graph = layer_table(), modules(), import_graph()
    below = {name for name, path in known.items() if layer_of(path, table) != 0}
    packages: dict[str, dict[str, int]] = {}
    for name in below:
        for target, line in graph[name].items():
            source, destination = ".".join(name.split(".")[:2]), ".".join(target.split(".")[:2])
            if target in below and source != destination:
                packages.setdefault(source, {})[destination] = line
    found = cycles(packages)
    assert not found, "packages that import each other: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_checks_catch_what_they_are_for():
    """The graph helpers on a made-up graph: a cycle is found, a chain is not."""
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []
    table = layer_table()
    assert layer_of(PACKAGE / "client" / "model.py", table) < layer_of(PACKAGE / "client" / "sequence.py", table)
    assert layer_of(PACKAGE / "dht" / "__main__.py", table) == 0  # the most specific path wins


def test_ci_runs_the_readmes_test_command_in_a_fresh_environment():
    """`.ci/run` runs the README's install-lint-and-test command, word for word but for pip's --quiet, inside a virtual
    environment it has just made (the README says CI runs exactly that; the machine's own packages once hid an
    undeclared test dependency)."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r'(pip install torch==2\.13\.0 && pip install -e "\.\[test\]" && ruff check \. && '
                        r'python -m pytest[^\n`]*)', readme).group(1).strip()
    script = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    lines = [" ".join(line.replace("--quiet ", "").split()) for line in script.splitlines()]
    assert command in lines, f"README: {command!r}; .ci/run runs: {[line for line in lines if 'pytest' in line]}"
    made = next(i for i, line in enumerate(lines) if re.fullmatch(r'python3? -m venv "\$venv"', line))
    entered = next(i for i, line in enumerate(lines) if line == '. "$venv/bin/activate"')
    assert made < entered < lines.index(command)
    assert re.search(r'venv="\$\(mktemp -d ', script), "a new folder every run, not one left from the last"


def test_every_test_the_docs_name_exists():
    """Docs name tests as ``test_FILE.py::test_name`` (TESTING.md's guards table, the threat model): a renamed or
    removed test leaves a claim nobody checks, so each name must still be defined in its file (``name...`` is a
    prefix)."""
    sources = {path.name: path.read_text() for path in (ROOT / "tests").glob("test_*.py")}
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for file, name, prefix in re.findall(r"(test_\w+\.py)::(test_\w+)(\.\.\.)?", doc.read_text()):
            if not re.search(rf"def {name}{'' if prefix else '[(]'}", sources.get(file, "")):
                missing.append(f"{doc.name}: {file}::{name}")
    assert missing == []
