"""A walk over the package's source that finds every DHT read and store and where its key comes from.

A *sink* is a call that takes a DHT key: hivemind's ``dht.store``, ``dht.get``, ``node.store_many``, ``node.get_many``
(on a receiver named ``dht`` or ``node``), and, found by the walk, every function of the package that passes one
of its parameters on to a sink as the key (``store_slot``, ``read_owned``, ``signed_entries``...). A key expression is
*declared* when it is ``FAMILY.key(...)`` of a family in ``swarm.dht.keys``, a call of a function whose every return
is declared (a key builder such as ``block_key``), a name assigned only declared values in its function, a list or
comprehension of declared items, or a parameter (then its function is a sink, checked at its callers).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterable, Optional

from tests.source_trees import parse_source

RAW_SINKS = {"store": ("key", 0), "get": ("key", 0), "store_many": ("keys", 0), "get_many": ("keys", 0)}
RECEIVERS = {"dht", "node"}


@dataclass
class Function:
    module: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    params: list[str]  # positional parameters as callers pass them (``self`` / ``cls`` left out)

    @property
    def name(self) -> str:
        return self.node.name

    # The walk to a fixed point reads each function's calls many times and its assignments once per name it
    # resolves: walked once here (nested functions included, as ``ast.walk`` does), not at every read (that was
    # most of this test's 4-8 CPU s).
    @cached_property
    def nodes(self) -> list[ast.AST]:
        return list(ast.walk(self.node))

    @cached_property
    def calls(self) -> list[ast.Call]:
        return [node for node in self.nodes if isinstance(node, ast.Call)]

    @cached_property
    def assignments(self) -> dict[str, list[ast.AST]]:
        """Name -> the values assigned to it (plain and annotated assignments, loop targets' iterables), in order."""
        values: dict[str, list[ast.AST]] = {}
        for node in self.nodes:
            if isinstance(node, ast.Assign):
                names = [target.id for target in node.targets if isinstance(target, ast.Name)]
                value = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                names, value = [node.target.id], node.value
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)) and isinstance(node.target, ast.Name):
                names, value = [node.target.id], node.iter  # a list of declared keys is declared element by element
            else:
                continue
            for name in dict.fromkeys(names):  # `a = a = x` is one value
                values.setdefault(name, []).append(value)
        return values


@dataclass
class Walk:
    families: set[str]  # names of the key families (``swarm.dht.keys``)
    functions: list[Function] = field(default_factory=list)
    sinks: dict[str, tuple[str, int]] = field(default_factory=dict)  # function name -> key parameter and position
    builders: set[str] = field(default_factory=set)  # functions whose every return is a declared key
    sites: list[tuple[str, int, str]] = field(default_factory=list)  # (module, line, sink) of every key passed
    undeclared: list[str] = field(default_factory=list)
    families_used: set[str] = field(default_factory=set)

    # ----- reading the source -----
    def add_source(self, module: str, source: str) -> None:
        for node in ast.walk(parse_source(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [a.arg for a in node.args.posonlyargs + node.args.args]
                if params and params[0] in ("self", "cls"):
                    params = params[1:]
                self.functions.append(Function(module, node, params + [a.arg for a in node.args.kwonlyargs]))

    # ----- resolving a key expression: "ok", "param:NAME" or "bad" -----
    def resolve(self, expr: ast.AST, function: Function, seen: frozenset = frozenset()) -> set[str]:
        if isinstance(expr, ast.Call):
            if self._is_key_call(expr):
                return {"ok"}
            if _last_name(expr.func) in ("list", "tuple", "sorted", "set", "dict") and expr.args:
                return self.resolve(expr.args[0], function, seen)
            return {"bad"}
        if isinstance(expr, (ast.List, ast.Tuple, ast.Set)):
            return set().union(*(self.resolve(e, function, seen) for e in expr.elts)) or {"ok"}
        if isinstance(expr, ast.Constant) and expr.value is None:  # no key at all (signed_entries(dht, None, own))
            return {"ok"}
        if isinstance(expr, ast.Dict):  # {key: value}: its keys
            return set().union(*(self.resolve(e, function, seen) for e in expr.keys if e is not None)) or {"ok"}
        if isinstance(expr, (ast.Starred, ast.Subscript)):  # *keys, keys[0]: what the list holds
            return self.resolve(expr.value, function, seen)
        if isinstance(expr, ast.BoolOp):  # own or {}: either
            return set().union(*(self.resolve(e, function, seen) for e in expr.values))
        if isinstance(expr, ast.IfExp):
            return self.resolve(expr.body, function, seen) | self.resolve(expr.orelse, function, seen)
        if isinstance(expr, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            return self.resolve(expr.elt, function, seen)
        if isinstance(expr, ast.DictComp):
            return self.resolve(expr.key, function, seen)
        if isinstance(expr, ast.Name):
            if expr.id in seen:
                return {"bad"}
            values = function.assignments.get(expr.id)
            if values:
                return set().union(*(self.resolve(v, function, seen | {expr.id}) for v in values))
            if expr.id in function.params:
                return {f"param:{expr.id}"}
        return {"bad"}

    def key_argument(self, call: ast.Call) -> Optional[tuple[str, ast.AST]]:
        """(sink name, key expression) if ``call`` passes a key to a sink."""
        callee, args, keywords = call.func, call.args, {k.arg: k.value for k in call.keywords if k.arg}
        name = _last_name(callee)
        if name == "partial" and args:  # partial(F, keys=...): F called with those keywords
            callee, name, args = args[0], _last_name(args[0]), []
        if isinstance(callee, ast.Attribute) and name in RAW_SINKS and _last_name(callee.value) in RECEIVERS:
            param, position = RAW_SINKS[name]
        elif name in self.sinks:
            param, position = self.sinks[name]
        else:
            return None
        if param in keywords:
            return name, keywords[param]
        return (name, args[position]) if position < len(args) else None

    def run(self) -> "Walk":
        """Find sinks and builders until nothing changes, then record every undeclared key and the families used."""
        self.families_used = {_last_name(call.func.value) for function in self.functions
                              for call in function.calls if isinstance(call.func, ast.Attribute)
                              and call.func.attr == "key" and _last_name(call.func.value) in self.families}
        changed = True
        while changed:
            changed = False
            for function in self.functions:
                if function.name not in self.builders and self._returns_declared(function):
                    self.builders.add(function.name)
                    changed = True
                for call in function.calls:
                    found = self.key_argument(call)
                    if found is None:
                        continue
                    for result in self.resolve(found[1], function):
                        param = result.partition("param:")[2]
                        if param and function.name not in self.sinks:
                            self.sinks[function.name] = (param, function.params.index(param))
                            changed = True
        self.sites, self.undeclared = [], []
        for function in self.functions:
            for call in function.calls:
                found = self.key_argument(call)
                if found is None:
                    continue
                self.sites.append((function.module, call.lineno, found[0]))
                if "bad" in self.resolve(found[1], function):
                    self.undeclared.append(f"{function.module}:{call.lineno}: {found[0]}({ast.unparse(found[1])}) in "
                                           f"{function.name}")
        return self

    def _returns_declared(self, function: Function) -> bool:
        """Whether every return of ``function`` is ``FAMILY.key(...)`` or a call of a key builder."""
        returns = [n.value for n in function.nodes if isinstance(n, ast.Return)]
        return bool(returns) and all(self._is_key_call(value) for value in returns)

    def _is_key_call(self, value: Optional[ast.AST]) -> bool:
        if not isinstance(value, ast.Call):
            return False
        callee = value.func
        if isinstance(callee, ast.Attribute) and callee.attr == "key":
            return _last_name(callee.value) in self.families
        return _last_name(callee) in self.builders


def _last_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def walk_package(root: Path, families: Iterable[str]) -> Walk:
    walk = Walk(set(families))
    for path in sorted(root.rglob("*.py")):
        walk.add_source(str(path.relative_to(root.parent)), path.read_text())
    return walk.run()
