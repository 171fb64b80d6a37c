"""Declarative validation: the constraints of a msgspec Struct's fields, stated on their types, checked once.

A field says what it accepts in its annotation: ``max_num_seqs: PositiveInt``,
``top_p: Annotated[float, Bound(gt=0, le=1)]``, ``backend: Literal["sim", "torch"]``,
``steps: PositiveInt | None``. A Struct calls ``validate(self, error)`` from its
``__post_init__``, and every declared constraint is checked, raising ``error`` with a
message that names the field and the value (``InvalidRequest(field, value, reason)`` for
requests, ``ConfigurationError("field=value: reason")`` for settings). Rules between
fields (this one only with that one) stay as code in ``__post_init__``, after the call.

What is checked: every ``int``, ``float`` and ``bool`` field (an ``int`` is never a
``bool``; a ``float`` takes an ``int`` but not a ``bool``), every ``Literal``, every
field whose type is a Struct, a ``dict`` or ``list`` whose items are one of those,
each optionally ``| None``, and the ``Bound`` of an ``Annotated`` number. Other
fields (``str``, ``Any``, unions of several types) are left to the Struct's own code:
a ``str`` field also takes a ``pathlib.Path`` today, and that stays so.

Why ``Bound`` rather than ``msgspec.Meta(ge=...)``: msgspec enforces a ``Meta``
constraint itself while decoding, before ``__post_init__``, with a message that names
the field but not the value (``Expected `int` >= 1 - at `$.max_tokens```), so a bad
value would read one way built in Python and another decoded from the wire. msgspec
ignores a ``Bound``; this module checks it on both paths, with one message (a decoder
wraps it in ``msgspec.ValidationError``, the typed error as its ``__cause__``).

Speed: ``SamplingParams`` is built for every request, so each class's checks are
compiled once, on its first instance, into one straight-line function (the way
``dataclasses`` builds ``__init__``); a valid instance costs one call and one test per
field. Explaining a failure is the slow path.

A leaf: it imports only ``errors`` and msgspec.
"""

from __future__ import annotations

import math
import threading
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal, NamedTuple, Union

import msgspec

from rlengine.errors import ConfigurationError, FieldError, RLEngineError

__all__ = [
    "MAX_ROLE_CHARS", "Bound", "FiniteFloat", "NonNegativeFloat", "NonNegativeInt", "Port", "PositiveFloat",
    "PositiveInt", "check_integer", "check_number", "check_role", "convert_error", "validate",
]


class Bound:
    """The range of an ``Annotated`` number: ``ge``/``gt`` below, ``le``/``lt`` above (any may be
    None), ``also`` values accepted outside it (``top_k`` -1), ``finite`` (floats: no inf, no nan;
    with both ends bounded nothing else gets through anyway) and a ``note`` the message adds."""

    __slots__ = ("also", "finite", "ge", "gt", "le", "lt", "note")

    def __init__(self, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
                 lt: float | None = None, also: tuple[float, ...] = (), finite: bool = True, note: str = "") -> None:
        if ge is not None and gt is not None or le is not None and lt is not None:
            raise TypeError("Bound: give at most one of ge/gt and one of le/lt")
        self.ge, self.gt, self.le, self.lt = ge, gt, le, lt
        self.also, self.finite, self.note = tuple(also), finite, note

    def __repr__(self) -> str:
        set_ = (f"{k}={getattr(self, k)!r}" for k in ("ge", "gt", "le", "lt", "also", "note") if getattr(self, k))
        return f"Bound({', '.join(set_)})"


PositiveInt = Annotated[int, Bound(ge=1)]
NonNegativeInt = Annotated[int, Bound(ge=0)]
PositiveFloat = Annotated[float, Bound(gt=0)]
"""Finite and > 0."""
NonNegativeFloat = Annotated[float, Bound(ge=0)]
"""Finite and >= 0."""
FiniteFloat = Annotated[float, Bound()]
Port = Annotated[int, Bound(ge=0, le=65535)]
"""A TCP port to listen on; 0: any free one."""


# -- compiling a class's checks ------------------------------------------------------------------

class _Rule(NamedTuple):
    """What one type accepts: ``expr``, a Python expression over ``v`` (compiled into the class's
    check), ``what`` it must be (for the message), and for a container ``find``, which names the
    offending item."""

    expr: str
    what: str
    find: Callable[[str, Any], tuple[str, Any, str]] | None = None
    choices: tuple[str, ...] = ()
    """A literal's values, shown: ``| None`` adds None to the list rather than another "or"."""


class _Names:
    """The constants a class's compiled check refers to (bounds, literal values, classes)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {"_isfinite": math.isfinite}

    def add(self, value: Any) -> str:
        name = f"_c{len(self.values)}"
        self.values[name] = value
        return name


_INT = "(v.__class__ is int or (isinstance(v, int) and v.__class__ is not bool))"
_NUMBER = ("(v.__class__ is float or v.__class__ is int "
           "or (isinstance(v, (int, float)) and v.__class__ is not bool))")


def _show(x: float) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


_UNBOUNDED = Bound(finite=False)
"""A plain ``int`` or ``float`` field: its type only."""


def _bounded(base: Any, bound: Bound, names: _Names) -> _Rule:
    if base not in (int, float):
        raise TypeError(f"Bound applies to int and float fields, not {base!r}")
    integer = base is int
    lo, lo_op = (bound.ge, ">=") if bound.ge is not None else (bound.gt, ">")
    hi, hi_op = (bound.le, "<=") if bound.le is not None else (bound.lt, "<")
    ranged = [f"v {op} {names.add(end)}" for end, op in ((lo, lo_op), (hi, hi_op)) if end is not None]
    # Bounded on both ends, a float is finite already (nan fails every comparison). Ints are
    # finite, and a huge one would overflow isfinite, so they skip it.
    finite = not integer and bound.finite and (lo is None or hi is None)
    if finite:
        ranged.append("(isinstance(v, int) or _isfinite(v))")
    tests = [_INT if integer else _NUMBER]
    if ranged and bound.also:
        tests.append(f"(v in {names.add(bound.also)} or ({' and '.join(ranged)}))")
    else:
        tests += ranged
    what = "an integer" if integer else ("a finite number" if finite else "a number")
    if lo is not None and hi is not None:
        what += f" in {'[' if lo_op == '>=' else '('}{_show(lo)}, {_show(hi)}{']' if hi_op == '<=' else ')'}"
    elif lo is not None or hi is not None:
        what += f" {lo_op if lo is not None else hi_op} {_show(lo if lo is not None else hi)}"
    if bound.also:
        what = f"{' or '.join(_show(a) for a in bound.also)} or {what}"
    if bound.note:
        what += f" ({bound.note})"
    return _Rule(" and ".join(tests), what)


def _literal(values: tuple[Any, ...], names: _Names) -> _Rule:
    # The class test first: ``True in (1, 2)`` holds. A str subclass (an enum's value) is a str.
    kinds = tuple({type(x) for x in values})
    cls = f"isinstance(v, {names.add(kinds)})" + ("" if bool in kinds else " and v.__class__ is not bool")
    shown = tuple(repr(x) for x in values)
    return _Rule(f"{cls} and v in {names.add(values)}", _one_of(shown), choices=shown)


def _one_of(shown: tuple[str, ...]) -> str:
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


def _item_check(rule: _Rule, names: _Names) -> Callable[[Any], bool]:
    """``rule`` as a function of one value (a container checks its items with it)."""
    namespace = dict(names.values)
    exec(f"def ok(v):\n    return {rule.expr}\n", namespace)  # noqa: S102 - source built from annotations only
    return typing.cast(Callable[[Any], bool], namespace["ok"])


def _container(origin: Any, args: tuple[Any, ...], names: _Names) -> _Rule | None:
    if origin is dict:
        key, value = args if len(args) == 2 else (Any, Any)
        item = _rule(value, names)
        if item is None or key is not str:
            return None
        ok = _item_check(item, names)

        def find_in_dict(field: str, v: Any) -> tuple[str, Any, str]:
            if not isinstance(v, dict):
                return field, v, "must be a dict"
            for k, x in v.items():
                if not isinstance(k, str):
                    return field, k, "keys must be strings"
                if not ok(x):
                    return _explain(item, f"{field}[{k!r}]", x)
            raise AssertionError("no offending item")  # pragma: no cover - only called after a failed check

        # isinstance, as ``find_in_dict`` tests: a dict subclass is a dict.
        expr = f"isinstance(v, dict) and all(isinstance(k, str) and {names.add(ok)}(x) for k, x in v.items())"
        return _Rule(expr, "a dict", find_in_dict)
    if origin is list:
        item = _rule(args[0], names) if args else None
        if item is None:
            return None
        ok = _item_check(item, names)

        def find_in_list(field: str, v: Any) -> tuple[str, Any, str]:
            if not isinstance(v, list):
                return field, v, "must be a list"
            for i, x in enumerate(v):
                if not ok(x):
                    return _explain(item, f"{field}[{i}]", x)
            raise AssertionError("no offending item")  # pragma: no cover - only called after a failed check

        return _Rule(f"isinstance(v, list) and all(map({names.add(ok)}, v))", "a list", find_in_list)
    return None


def _explain(rule: _Rule, field: str, value: Any) -> tuple[str, Any, str]:
    """``(field, value, reason)`` for a ``value`` that ``rule`` refused: a container names its offending item."""
    return rule.find(field, value) if rule.find is not None else (field, value, f"must be {rule.what}")


def _rule(tp: Any, names: _Names) -> _Rule | None:
    """What ``tp`` accepts, or None for a type this module leaves to the Struct's own code."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        bounds = [m for m in meta if isinstance(m, Bound)]
        if len(bounds) > 1:
            raise TypeError(f"{tp!r}: one Bound per type")
        return _bounded(base, bounds[0], names) if bounds else _rule(base, names)
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if len(args) != 2 or type(None) not in args:
            return None
        inner = _rule(args[0] if args[1] is type(None) else args[1], names)
        if inner is None:
            return None
        what = _one_of((*inner.choices, "None")) if inner.choices else f"{inner.what} or None"
        return _Rule(f"(v is None or ({inner.expr}))", what, inner.find)
    if origin is Literal:
        return _literal(typing.get_args(tp), names)
    if origin in (dict, list):
        return _container(origin, typing.get_args(tp), names)
    if tp is bool:
        return _Rule("(v is True or v is False)", "true or false", choices=("true", "false"))
    if tp in (int, float):
        return _bounded(tp, _UNBOUNDED, names)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return _Rule(f"isinstance(v, {names.add(tp)})", f"a {tp.__name__}")
    return None


class _Plan(NamedTuple):
    """A class's compiled check (the index of the first failing field, or -1) and its fields' rules."""

    check: Callable[[Any], int]
    fields: tuple[tuple[str, _Rule], ...]


def _compile(cls: type) -> _Plan:
    hints = typing.get_type_hints(cls, include_extras=True)
    names = _Names()
    fields = tuple((name, rule) for name in cls.__struct_fields__
                   if (rule := _rule(hints[name], names)) is not None)
    lines = ["def check(obj):"]
    for i, (name, rule) in enumerate(fields):
        lines += [f"    v = obj.{name}", f"    if not ({rule.expr}):", f"        return {i}"]
    lines.append("    return -1")
    namespace = dict(names.values)
    exec("\n".join(lines) + "\n", namespace)  # noqa: S102 - source built from the class's annotations only
    return _Plan(namespace["check"], fields)


_PLANS: dict[type, _Plan] = {}
_COMPILING = threading.Lock()


def _plan(cls: type) -> _Plan:
    with _COMPILING:
        plan = _PLANS.get(cls)
        if plan is None:
            plan = _PLANS[cls] = _compile(cls)
        return plan


def _raise(error: type[RLEngineError], field: str, value: Any, reason: str) -> typing.NoReturn:
    if issubclass(error, FieldError):
        raise error(field, value, reason)
    raise error(f"{field}={value!r}: {reason}")


def validate(obj: msgspec.Struct, error: type[RLEngineError], prefix: str = "") -> None:
    """Check every constraint declared on ``obj``'s fields (see the module docstring), raising
    ``error`` for the first one it breaks: a ``FieldError`` subclass as ``error(field, value, reason)``,
    any other as ``error("field=value: reason")``; ``prefix`` goes before field names
    (``"sim."``). The class's checks are compiled on its first call and cached."""
    plan = _PLANS.get(obj.__class__) or _plan(obj.__class__)
    failed = plan.check(obj)
    if failed >= 0:
        name, rule = plan.fields[failed]
        value = getattr(obj, name)
        field, shown, reason = _explain(rule, prefix + name, value)
        _raise(error, field, shown, reason)


# -- the same rules for one value, outside a Struct ------------------------------------------------

_VALUE_CHECKS: dict[tuple[Any, ...], tuple[Callable[[Any], bool], str]] = {}


def _value_check(base: type, bound: Bound, key: tuple[Any, ...]) -> tuple[Callable[[Any], bool], str]:
    found = _VALUE_CHECKS.get(key)
    if found is None:
        names = _Names()
        rule = _bounded(base, bound, names)
        found = _VALUE_CHECKS[key] = (_item_check(rule, names), rule.what)
    return found


def check_integer(name: str, value: object, minimum: int | None, maximum: int | None = None) -> None:
    """A ``ConfigurationError`` naming ``name`` unless ``value`` is an integer (>= ``minimum``,
    <= ``maximum``): a ``PositiveInt`` field's rule, for a value that is not a field."""
    ok, what = _value_check(int, Bound(ge=minimum, le=maximum), (int, minimum, maximum))
    if not ok(value):
        _raise(ConfigurationError, name, value, f"must be {what}")


def check_number(name: str, value: object, minimum: float | None, exclusive: bool = False,
                 maximum: float | None = None) -> None:
    """A ``ConfigurationError`` naming ``name`` unless ``value`` is a finite number (>= ``minimum``,
    or > with ``exclusive``; <= ``maximum``)."""
    bound = Bound(gt=minimum, le=maximum) if exclusive else Bound(ge=minimum, le=maximum)
    ok, what = _value_check(float, bound, (float, minimum, exclusive, maximum))
    if not ok(value):
        _raise(ConfigurationError, name, value, f"must be {what}")


MAX_ROLE_CHARS = 64
"""Longest agent role name (a multi-agent episode's, an HTTP turn's ``X-RLEngine-Role``)."""


def check_role(field: str, value: object, error: type[RLEngineError],
               declared: typing.Collection[str] | None = None) -> str:
    """``value`` as an agent role, or ``error`` naming ``field``: a non-empty string of at most
    ``MAX_ROLE_CHARS`` printable characters, one of ``declared`` when roles are declared. One rule
    for the RL episodes and the HTTP sessions, so a role valid in one is valid in the other."""
    if not isinstance(value, str) or not value:
        _raise(error, field, value, "must be a non-empty string (an agent role)")
    if len(value) > MAX_ROLE_CHARS or not value.isprintable():
        _raise(error, field, value, f"must be at most {MAX_ROLE_CHARS} printable characters")
    if declared is not None and value not in declared:
        _raise(error, field, value, f"not a declared role (declared: {', '.join(sorted(declared)) or 'none'})")
    return value


def convert_error(cls: type, exc: msgspec.ValidationError, given: dict[str, Any]) -> str:
    """The message for ``msgspec.convert(given, cls)`` failing with ``exc``: where msgspec refused a
    top-level field's value before ``__post_init__`` could (a ``Literal`` it does not hold, a string
    for a number), the message ``validate`` gives for it (the field, the value and what is accepted,
    a ``Literal``'s choices included); else msgspec's own."""
    field = str(exc).rpartition(" - at `$.")[2].rstrip("`")
    if field in given and field in cls.__struct_fields__:
        try:
            cls(**{field: given[field]})
        except RLEngineError as declared:
            return str(declared)
        except (TypeError, ValueError):  # other fields are required, or the class refuses it otherwise
            pass
    return str(exc)
