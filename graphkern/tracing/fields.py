"""What an attribute's value may be: the small checkers the schema's tables are written with.

Each checker says in words what it accepts (``expected``) and, for a value it does not accept,
what is wrong with it, naming the place inside the value (``template_floats['EPS']``,
``template[0]``) so that a hand-edited graph file is refused with the field to fix. Values are
JSON's: ``None``, ``bool``, ``int``, ``float``, ``str``, lists (tuples in memory) and objects.

>>> MapOf(NUMBER).problem({"EPS": "x"}, "template_floats")
"template_floats['EPS'] must be a number, got str"
>>> ListOf(PAIR).problem([["T", "float32"], [1, 2, 3]], "template")
'template[1] must be a [name, value] pair of strings, got a list of 3'
>>> Maybe(COUNT).problem(None, "peer") is None
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["COUNT", "FLAG", "INT", "NUMBER", "PAIR", "TEXT", "Check", "ListOf", "MapOf", "Maybe", "OneOf",
           "Record", "Spec", "Typed", "Whole", "type_name", "typed"]


def typed(value: Any, types: tuple[type, ...]) -> bool:
    """``value`` is of one of ``types``, a bool counting as an int only where ``bool`` is listed."""
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def type_name(value: Any) -> str:
    """The JSON-ish name of a value's type, for messages (``None`` rather than ``NoneType``)."""
    return "None" if value is None else type(value).__name__


def _wrong(path: str, expected: str, value: Any) -> str:
    return f"{path} must be {expected}, got {type_name(value)}"


class Spec:
    """What a value must be: ``expected`` in words; ``problem(value, path)`` is None for a value
    that is one, else a sentence naming ``path`` (or the place inside it) and what is wrong."""

    expected: str = "a value"

    def problem(self, value: Any, path: str) -> str | None:
        raise NotImplementedError


@dataclass(frozen=True)
class Typed(Spec):
    """A value of one of ``types`` (an int is never a bool unless ``bool`` is listed)."""

    types: tuple[type, ...]
    expected: str

    def problem(self, value: Any, path: str) -> str | None:
        return None if typed(value, self.types) else _wrong(path, self.expected, value)


@dataclass(frozen=True)
class Whole(Spec):
    """An int (not a bool) of at least ``minimum``."""

    minimum: int | None = None
    expected: str = "an int"

    def problem(self, value: Any, path: str) -> str | None:
        if not typed(value, (int,)):
            return _wrong(path, self.expected, value)
        if self.minimum is not None and value < self.minimum:
            return f"{path} must be {self.expected}, got {value}"
        return None


@dataclass(frozen=True)
class Maybe(Spec):
    """None, or what ``spec`` accepts."""

    spec: Spec

    @property
    def expected(self) -> str:  # type: ignore[override]
        return f"{self.spec.expected} or None"

    def problem(self, value: Any, path: str) -> str | None:
        if value is None:
            return None
        found = self.spec.problem(value, path)
        if found == _wrong(path, self.spec.expected, value):  # not even of the right type: say None would do
            return _wrong(path, self.expected, value)
        return found


@dataclass(frozen=True)
class OneOf(Spec):
    """What any of ``specs`` accepts; a value none accepts is described by ``expected``."""

    specs: tuple[Spec, ...]
    expected: str

    def problem(self, value: Any, path: str) -> str | None:
        if any(spec.problem(value, path) is None for spec in self.specs):
            return None
        return _wrong(path, self.expected, value)


@dataclass(frozen=True)
class ListOf(Spec):
    """A list (a tuple, in memory) whose items ``item`` accepts; of ``length`` items when given."""

    item: Spec
    length: int | None = None
    expected: str = "a list"

    def problem(self, value: Any, path: str) -> str | None:
        if not isinstance(value, (list, tuple)):
            return _wrong(path, self.expected, value)
        if self.length is not None and len(value) != self.length:
            return f"{path} must be {self.expected}, got a list of {len(value)}"
        for i, item in enumerate(value):
            found = self.item.problem(item, f"{path}[{i}]")
            if found is not None:
                return found
        return None


@dataclass(frozen=True)
class MapOf(Spec):
    """An object whose keys are strings and whose values ``value`` accepts."""

    value: Spec
    expected: str = "an object"

    def problem(self, value: Any, path: str) -> str | None:
        if not isinstance(value, dict):
            return _wrong(path, self.expected, value)
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{path} must have string keys, got {type_name(key)} {key!r}"
            found = self.value.problem(item, f"{path}[{key!r}]")
            if found is not None:
                return found
        return None


@dataclass(frozen=True)
class Record(Spec):
    """An object whose known keys hold what their spec accepts (other keys are left alone)."""

    fields: Mapping[str, Spec]
    expected: str = "an object"

    def problem(self, value: Any, path: str) -> str | None:
        if not isinstance(value, dict):
            return _wrong(path, self.expected, value)
        for key, spec in self.fields.items():
            if key in value:
                found = spec.problem(value[key], f"{path}[{key!r}]")
                if found is not None:
                    return found
        return None


@dataclass(frozen=True)
class Check(Spec):
    """A spec written as a function: ``test(value, path)`` gives the problem or None."""

    test: Callable[[Any, str], str | None]
    expected: str

    def problem(self, value: Any, path: str) -> str | None:
        return self.test(value, path)


TEXT = Typed((str,), "a string")
FLAG = Typed((bool,), "true or false")
NUMBER = Typed((int, float), "a number")
INT = Whole()
COUNT = Whole(0, "a non-negative int")
PAIR = ListOf(TEXT, 2, "a [name, value] pair of strings")
