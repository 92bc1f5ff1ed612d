"""Settings declared once: default, help text and bounds in one dataclass field, read by everything else.

A config dataclass (the sampler's :class:`~swarm.diffusion.config.GenerationConfig`, the server's
:class:`~swarm.server.config.ServerConfig`, the client's :class:`~swarm.client.config.ClientConfig`) makes each
field with :func:`setting`. From that one declaration:

* validation (:func:`check_settings`, :meth:`SettingField.check`) refuses a wrong type or a value out of bounds
  with a :class:`SettingError` naming the setting, for Python callers and remote input alike (never ``assert``);
* :mod:`swarm.cli.options` makes the command-line options (flag, type, default, help, bounds);
* the HTTP API makes its request fields (:mod:`swarm.api.schemas`), and tests keep the docs complete.

This module imports nothing heavy (no torch, no network), so a command can build its ``--help`` from it at once.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import typing
from dataclasses import dataclass
from typing import Any, Optional, Union

from swarm.utils.errors import EXIT_USAGE, SwarmError
from swarm.utils.text import listed

SETTING = "setting"  # the metadata key of a declared setting


class SettingError(SwarmError, ValueError):
    """A setting out of its bound; ``param`` names it (the HTTP API reports it as OpenAI's ``param``)."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def need(condition: bool, message: str, param: Optional[str] = None) -> None:
    """Refuse a setting with a message that says what to change (never ``assert``: it is remote input)."""
    if not condition:
        raise SettingError(message, param)


def shown(value: Any, limit: int = 80) -> str:
    """A value as an error message quotes it: cut, so that a huge value is not echoed back whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def need_float(name: str, value: Any, low: float, high: Optional[float], low_open: bool = False,
               param: Optional[str] = None) -> None:
    """A finite number in [low, high] (or (low, high] with ``low_open``; no upper bound when ``high`` is None);
    NaN and infinities are refused."""
    ok = is_number(value) and math.isfinite(value) and (value > low if low_open else value >= low)
    if high is None:
        interval = f"{'>' if low_open else '>='} {low:g}"
        need(ok, f"{name} must be a finite number {interval}, got {shown(value)}", param or name)
    else:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        need(ok and value <= high, f"{name} must be a finite number in {interval}, got {shown(value)}", param or name)


def need_int(name: str, value: Any, low: int, high: Optional[int], param: Optional[str] = None) -> None:
    """An integer in low..high (no upper bound when ``high`` is None)."""
    need(is_integer(value), f"{name} must be an integer, got {shown(value)}", param or name)
    if high is None:
        need(value >= low, f"{name} must be at least {low}, got {value}", param or name)
    else:
        need(low <= value <= high, f"{name} must be {low}..{high}, got {value}", param or name)


@dataclass(frozen=True)
class Setting:
    """The declaration of one setting besides its name, type and default.

    Read by validation (:meth:`SettingField.check`), the command line (:mod:`swarm.cli.options`), the HTTP
    API's request fields (:mod:`swarm.api.schemas`) and the tests that keep the documentation complete, so that
    a setting is declared once.
    """

    help: str
    low: Optional[float] = None
    high: Union[float, str, None] = None  # a number, the name of the setting that bounds it, or None: unbounded
    low_open: bool = False  # (low, high] instead of [low, high]
    choices: tuple[str, ...] = ()
    computed_default: str = ""  # how the default follows from other settings (the default is then None)
    cli: bool = True  # offered as a command-line option
    api: bool = True  # offered as a request field of the HTTP API (generation settings)
    flags: tuple[str, ...] = ()  # the option's names when not ``--name`` (``--backward``, ``--governance-key``)
    path: bool = False  # a file path: Python callers may give a ``pathlib.Path`` as well as a string
    directory: bool = False  # a path the command line checks is an existing directory


def setting(default: Any, help: str, **declaration: Any) -> Any:
    """A dataclass field declaring a setting: its default, help text and bounds (see :class:`Setting`)."""
    return dataclasses.field(default=default, metadata={SETTING: Setting(help, **declaration)})


@dataclass(frozen=True)
class SettingField:
    """One declared setting of a dataclass: name, resolved type, default and declaration."""

    name: str
    type: Any
    default: Any
    spec: Setting

    @property
    def optional(self) -> bool:
        """Whether None is allowed (it then means "not used" or "chosen later")."""
        return typing.get_origin(self.type) is Union and type(None) in typing.get_args(self.type)

    @property
    def kind(self) -> Any:
        """The type without ``Optional``: int, float, str, bool, or the annotation itself for anything else."""
        args = [arg for arg in typing.get_args(self.type) if arg is not type(None)]
        return args[0] if self.optional and len(args) == 1 else self.type

    @property
    def repeated(self) -> bool:
        """A tuple of strings (``governance_keys``): a repeatable option on the command line."""
        return typing.get_origin(self.kind) is tuple

    @property
    def flag(self) -> str:
        """The option's main name: ``gen_length`` -> ``--gen-length`` unless declared otherwise."""
        return self.spec.flags[0] if self.spec.flags else "--" + self.name.replace("_", "-")

    def bounds(self) -> str:
        """The declared range (``0..3``, ``[0, 10]``, ``(0, 1]``, ``>= 1``) or choices, as help texts show them."""
        spec = self.spec
        if spec.choices:
            return ", ".join(spec.choices)
        if spec.low is None:
            return ""
        if spec.high is None:
            return f"{'>' if spec.low_open else '>='} {spec.low:g}"
        if self.kind is int:
            return f"{spec.low}..{_number(spec.high)}"
        return f"{'(' if spec.low_open else '['}{spec.low:g}, {_number(spec.high)}]"

    def describe(self, choices: bool = True) -> str:
        """The help text, then the declared bounds and a computed default: for ``--help`` and the API schema.

        ``choices`` False leaves the choices out (click lists them itself).
        """
        shown_bounds = self.bounds() if choices or not self.spec.choices else ""
        notes = [shown_bounds and f"{'One of' if self.spec.choices else 'Range'}: {shown_bounds}.",
                 self.spec.computed_default and f"Default: {self.spec.computed_default}."]
        return " ".join([self.spec.help, *filter(None, notes)])

    def check(self, value: Any, owner: Any = None, label: str = "") -> None:
        """Refuse ``value`` unless it has this setting's type and lies within its declared bounds.

        ``owner`` (the object being validated) gives the value of a bound named by another setting; ``label``
        names the setting in the message (default: its name, which is also the error's ``param``).
        """
        spec, name = self.spec, label or self.name
        if value is None and self.optional:
            return
        if spec.choices:
            need(isinstance(value, str) and value in spec.choices,
                 f"unknown {name} {shown(value)}; choose one of {', '.join(spec.choices)}", self.name)
        elif self.kind is bool:
            need(isinstance(value, bool), f"{name} must be true or false, got {shown(value)}", self.name)
        elif self.kind is int and spec.low is None:
            need(is_integer(value), f"{name} must be an integer, got {shown(value)}", self.name)
        elif self.kind is int:
            high = getattr(owner, spec.high) if isinstance(spec.high, str) else spec.high
            need_int(name, value, int(spec.low), None if high is None else int(high), self.name)
        elif self.kind is float and spec.low is not None:
            need_float(name, value, spec.low, spec.high, low_open=spec.low_open, param=self.name)
        elif self.kind is float:
            need(is_number(value) and math.isfinite(value), f"{name} must be a finite number, got {shown(value)}",
                 self.name)
        elif self.kind is str:
            need(self._is_text(value), f"{name} must be a string, got {shown(value)}", self.name)
        elif self.repeated:
            need(isinstance(value, (tuple, list)) and all(map(self._is_text, value)),
                 f"{name} must be a tuple of strings, got {shown(value)}", self.name)

    def _is_text(self, value: Any) -> bool:
        """A string, or a path object where the setting is a path."""
        return isinstance(value, str) or ((self.spec.path or self.spec.directory) and isinstance(value, os.PathLike))


def _number(value: Union[float, str]) -> str:
    """A bound as help texts write it: ``10``, ``2**63-1``, or the name of the setting that bounds it."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and value > 2**20 and (value + 1).bit_length() - 1 == value.bit_length():
        return f"2**{value.bit_length()}-1"
    return f"{value:g}"


@functools.lru_cache(maxsize=None)
def settings_of(cls: type) -> tuple[SettingField, ...]:
    """The declared settings of a dataclass (fields made with :func:`setting`), in declaration order."""
    hints = typing.get_type_hints(cls)
    return tuple(SettingField(f.name, hints[f.name], f.default, f.metadata[SETTING])
                 for f in dataclasses.fields(cls) if SETTING in f.metadata)


def declared(cls: type, name: str) -> SettingField:
    """The declared setting ``name`` of ``cls`` (a KeyError names a setting that is not declared)."""
    return {field.name: field for field in settings_of(cls)}[name]


def check_settings(config: Any) -> None:
    """Check every declared setting of ``config`` (a dataclass instance), naming it as ``Class.field``."""
    owner = type(config).__name__
    for declared in settings_of(type(config)):
        declared.check(getattr(config, declared.name), config, label=f"{owner}.{declared.name}")


def replaced(config: Any, what: str, **changes: Any) -> Any:
    """A copy of the dataclass ``config`` with ``changes`` (the original is left alone); an unknown name is a
    TypeError naming it (``what``: "client option")."""
    names = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise TypeError(f"unknown {listed(what, [repr(name) for name in unknown])}; known: {', '.join(sorted(names))}")
    return dataclasses.replace(config, **changes)
