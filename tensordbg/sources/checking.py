"""Checking a value against the wire schema: what the conformance tests do to every source's
replies, and the UI to what it receives."""

from __future__ import annotations

import functools
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from tensordbg.sources.schema import Summary

if sys.version_info >= (3, 11):
    from typing import NotRequired, get_type_hints
else:  # typing's TypedDict learnt NotRequired in 3.11
    from typing_extensions import NotRequired, get_type_hints


class SchemaError(ValueError):
    """A value that does not match its schema; the message says where and how.

    >>> check({"state": "paused"}, Control, name="control")
    SchemaError: control: missing 'step'
    """


def check(value: Any, schema: Any, *, name: str = "reply", strict: bool = False) -> None:
    """Raise :class:`SchemaError` unless ``value`` matches ``schema`` (a TypedDict above, or a
    type hint made of them: ``list[Hit]``, ``Hit | None``...).

    Keys a TypedDict does not name are let through (a newer source may send more, and the UI
    ignores what it does not know) unless ``strict``, as the conformance tests ask, so that the
    schema here stays complete; a :class:`Summary` is open to any statistic either way.

    >>> check(source.stats(3), Stats)
    """
    problem = _checker(schema)(value, strict)
    if problem is not None:
        raise SchemaError(name + problem)


def conforms(value: Any, schema: Any) -> bool:
    """Whether ``value`` matches ``schema`` (as :func:`check`, without the reason)."""
    return _checker(schema)(value, False) is None


_OPEN = (Summary,)  # TypedDicts that may hold keys they do not name, even when strict

Checker = Callable[[Any, bool], "str | None"]
"""``checker(value, strict)``: None when the value matches, else where and what is wrong, as a
path under the value and a reason (``".summary.nan: expected float, got '2'"``). A reply is
checked on the UI's event loop: a schema is turned into a checker once, and a checker builds
the path only for what is wrong."""


@functools.cache
def _checker(hint: Any) -> Checker:
    if hint is Any:
        return lambda value, strict: None
    if _is_typeddict(hint):
        return _typeddict_checker(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _union_checker(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        what = " or ".join(map(repr, allowed))
        return lambda value, strict: None if value in allowed else _expected(what, value)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return _list_checker(_checker(item))
    if origin is dict:
        _, item = typing.get_args(hint) or (str, Any)
        return _dict_checker(_checker(item))
    return _kind_checker(hint)


def _typeddict_checker(schema: Any) -> Checker:
    name = schema.__name__
    is_open = schema in _OPEN
    fields: dict[str, Checker] = {}
    required = []
    # Not __required_keys__: it is wrong under `from __future__ import annotations` before 3.12.
    for key, hint in get_type_hints(schema, include_extras=True).items():
        if typing.get_origin(hint) is NotRequired:
            (hint,) = typing.get_args(hint)
        elif schema.__total__:
            required.append(key)
        fields[key] = _checker(hint)

    def check_typeddict(value: Any, strict: bool) -> str | None:
        if not isinstance(value, dict):
            return _expected(f"an object ({name})", value)
        missing = [key for key in required if key not in value]
        if missing:
            return f": missing {', '.join(map(repr, missing))}"
        for key, item in value.items():
            checker = fields.get(key)
            if checker is None:
                if strict and not is_open:
                    return f": {key!r} is not in the schema of {name}"
                continue
            problem = checker(item, strict)
            if problem is not None:
                return f".{key}{problem}"
        return None

    return check_typeddict


def _union_checker(hint: Any) -> Checker:
    options = typing.get_args(hint)
    checkers = [(_checker(h), _kind_fits(h)) for h in options]
    what = " or ".join(_name(h) for h in options)

    def check_union(value: Any, strict: bool) -> str | None:
        if any(checker(value, strict) is None for checker, _ in checkers):
            return None
        # The reason of the one option of the value's kind, if any: deeper than "expected".
        for checker, fits in checkers:
            if value is not None and fits(value):
                return checker(value, strict)
        return _expected(what, value)

    return check_union


def _list_checker(item: Checker) -> Checker:
    def check_list(value: Any, strict: bool) -> str | None:
        if not isinstance(value, list):
            return _expected("a list", value)
        for i, v in enumerate(value):
            problem = item(v, strict)
            if problem is not None:
                return f"[{i}]{problem}"
        return None

    return check_list


def _dict_checker(item: Checker) -> Checker:
    def check_dict(value: Any, strict: bool) -> str | None:
        if not isinstance(value, dict):
            return _expected("an object", value)
        for key, v in value.items():
            if not isinstance(key, str):
                return f" key{_expected('str', key)}"
            problem = item(v, strict)
            if problem is not None:
                return f".{key}{problem}"
        return None

    return check_dict


def _kind_checker(hint: Any) -> Checker:
    fits = _kind_fits(hint)
    what = _name(hint)
    return lambda value, strict: None if fits(value) else _expected(what, value)


def _kind_fits(hint: Any) -> Callable[[Any], bool]:
    """Whether a value is of the plain kind ``hint`` names (a bool is no number here)."""
    origin = typing.get_origin(hint) or hint
    if hint is type(None):
        return lambda value: value is None
    if _is_typeddict(hint) or origin is dict:
        return lambda value: isinstance(value, dict)
    if origin is list:
        return lambda value: isinstance(value, list)
    if origin is Literal:
        return lambda value: isinstance(value, str)
    if hint is float:
        return lambda value: (
            type(value) is float
            or (isinstance(value, (int, float)) and not isinstance(value, bool))
        )
    if hint is int:
        return lambda value: (
            type(value) is int or (isinstance(value, int) and not isinstance(value, bool))
        )
    if isinstance(origin, type):
        return lambda value: isinstance(value, origin)
    return lambda value: False


def _is_typeddict(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, dict) and hasattr(hint, "__total__")


def _name(hint: Any) -> str:
    if hint is type(None):
        return "None"
    if _is_typeddict(hint):
        return f"an object ({hint.__name__})"
    origin = typing.get_origin(hint)
    if origin is list:
        return "a list"
    if origin is dict:
        return "an object"
    return getattr(hint, "__name__", str(hint))


def _expected(what: str, value: Any) -> str:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f": expected {what}, got {shown}"
