"""The field checks of the node's message codec (runtime/messages.py): a message's wire values are
checked against its dataclass, each field by its annotation (exact scalar types, bounded strings,
lists and maps, nested messages and fixed-length tuples), then by the class's own `validate`, and
a value that breaks them raises MessageError."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

MAX_STR = 4096  # characters of any string field (messages, reasons, rids)
MAX_LIST = 1 << 22  # items of any list field (a prompt's token ids at most)
MAX_MAP = 4096  # entries of any map field


class MessageError(ValueError):
    """Bytes that are not one of our messages, or a message that breaks its schema."""


_SPECS: dict[type, tuple[tuple[str, ...], tuple[Callable[[Any], Any], ...], Callable | None]] = {}


def build(cls: type, values: list) -> Any:
    """A `cls` message from its wire field values, each checked; MessageError if one fails."""
    spec = _SPECS.get(cls)
    if spec is None:
        hints = typing.get_type_hints(cls)
        checks = tuple(
            _checker(hints[f.name], f"{cls.__name__}.{f.name}") for f in dataclasses.fields(cls)
        )
        names = tuple(f.name for f in dataclasses.fields(cls))
        spec = _SPECS[cls] = (names, checks, getattr(cls, "validate", None))
    names, checks, validate = spec
    if len(values) != len(checks):
        raise MessageError(f"{cls.__name__} has {len(checks)} fields, got {len(values)}")
    # by keyword: a keyword-only field (AddRequest.traceparent) keeps its wire place
    msg = cls(**{n: check(v) for n, check, v in zip(names, checks, values, strict=True)})
    if validate is not None:  # bounds beyond the types (a room's range, ...)
        validate(msg)
    return msg


def _checker(ann: Any, where: str) -> Callable[[Any], Any]:
    """A function that validates (and, for nested messages and tuples, builds) one field value."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (typing.Union, types.UnionType):
        return _union_checker(args, where)
    if ann in (bool, int, float, str) or ann is Any:
        return _scalar_checker(ann, where)
    if origin in (list, tuple, dict) or ann in (list, tuple, dict):
        return _container_checker(origin or ann, args, where)
    if getattr(ann, "tagged", False):  # any registered subclass, by its tag (StatsExtension)
        return lambda v: ann.from_wire(v, where)
    if dataclasses.is_dataclass(ann):

        def nested(v):
            if type(v) is not list:
                raise MessageError(f"{where}: expected a {ann.__name__} (a list)")
            return build(ann, v)

        return nested
    raise TypeError(f"{where}: no wire check for the annotation {ann!r}")


def _union_checker(args: tuple, where: str) -> Callable[[Any], Any]:
    options = [_checker(a, where) for a in args if a is not type(None)]
    optional = type(None) in args
    if len(options) == 1:  # `X | None`: no try/except on the hot path
        only = options[0]
        return lambda v: None if v is None else only(v)

    def one_of(v):
        if v is None and optional:
            return None
        for check in options:
            try:
                return check(v)
            except MessageError:
                pass
        raise MessageError(f"{where}: unexpected {type(v).__name__}")

    return one_of


def _scalar_checker(ann: Any, where: str) -> Callable[[Any], Any]:
    if ann is Any:
        return lambda v: v
    if ann is float:

        def real(v):
            if type(v) not in (float, int):
                raise MessageError(f"{where}: expected a number, got {type(v).__name__}")
            return float(v)

        return real
    if ann is str:

        def short_str(v):
            if type(v) is not str or len(v) > MAX_STR:
                raise MessageError(f"{where}: expected a string of at most {MAX_STR} characters")
            return v

        return short_str
    return _exact(ann, where)  # bool, int: exactly (True is no token id)


def _container_checker(kind: type, args: tuple, where: str) -> Callable[[Any], Any]:
    if kind is dict:
        key = _checker(args[0], where) if args else (lambda v: v)
        val = _checker(args[1], where) if args else (lambda v: v)

        def mapping(v):
            if type(v) is not dict or len(v) > MAX_MAP:
                raise MessageError(f"{where}: expected a map of at most {MAX_MAP} entries")
            return {key(k): val(x) for k, x in v.items()}

        return mapping
    if kind is tuple and args and args[-1] is not Ellipsis:  # a fixed-length tuple
        items = [_checker(a, where) for a in args]

        def record(v):
            if type(v) is not list or len(v) != len(items):
                raise MessageError(f"{where}: expected a list of {len(items)} items")
            return tuple(check(x) for check, x in zip(items, v, strict=True))

        return record
    item = _checker(args[0], where) if args else (lambda v: v)
    make = tuple if kind is tuple else list

    def seq(v):
        if type(v) is not list or len(v) > MAX_LIST:
            raise MessageError(f"{where}: expected a list of at most {MAX_LIST} items")
        return make(item(x) for x in v)

    return seq


def _exact(t: type, where: str) -> Callable[[Any], Any]:
    def check(v):
        if type(v) is not t:
            raise MessageError(f"{where}: expected {t.__name__}, got {type(v).__name__}")
        return v

    return check
