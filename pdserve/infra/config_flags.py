"""Command-line flags generated from config dataclasses: a setting's name, type, default, help,
choices, vLLM-style alias and environment variable are written once, on its dataclass field, and
the parser and the config are both made from that field.

    @dataclass(frozen=True)
    class NodeConfig:
        port: int = setting(30000, help="HTTP port")
        engine: EngineConfig = nested(EngineConfig, "engine")

    ap = argparse.ArgumentParser(); add_flags(ap, NodeConfig)
    cfg = config_from_args(NodeConfig, ap.parse_args())  # the edge: nothing past it sees `args`

A field with neither `setting` nor `nested` is no flag: it keeps its default (or is given by the
code that builds the config). A bool that defaults to False is a switch (`--flag`); one that
defaults to True gets `--flag` and `--no-flag` (argparse.BooleanOptionalAction); one with a `parse`
(e.g. parse_bool) takes an optional word: `--flag`, `--flag true`, `--flag false`. A value read
from a field's environment variable replaces the default, and --help shows which variable it was.

A setting's dest (its attribute in the parsed Namespace) is its field's name, after its nested
config's `prefix` if it has one; two settings with one dest are refused. With an `env_prefix`, a
setting without an `env` of its own reads ENV_PREFIX + its flag's name (--queue-timeout:
PDSERVE_ROUTER_QUEUE_TIMEOUT).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

SETTING = "pdserve_setting"
NESTED = "pdserve_nested"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class Flag:
    help: str
    flag: str | None = None  # default: --field-name
    aliases: tuple[str, ...] = ()  # other spellings, vLLM's where the meaning is the same
    choices: tuple[Any, ...] | None = None
    env: str | None = None  # an environment variable that sets the default
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # from a flag's text, where the type's own is wrong
    secret: bool = False  # --help never shows its value (an API key read from the environment)

    def names(self, name: str) -> list[str]:
        """`name`: the setting's dest (its field's name, after its nested config's prefix)."""
        return [self.flag or "--" + name.replace("_", "-"), *self.aliases]


def setting(
    default: Any = MISSING,
    *,
    help: str,
    default_factory: Any = MISSING,
    **flag: Any,
) -> Any:
    """A dataclass field that is a command-line flag (Flag's fields as keywords)."""
    meta = {SETTING: Flag(help=help, **flag)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Nested:
    cls: type
    title: str
    prefix: str = ""


def nested(cls: type, title: str, *, prefix: str = "") -> Any:
    """A field holding another config (a `cls`, which may be a subclass of the field's type) whose
    settings are flags of this one's parser, in a group titled `title`. `prefix` goes before its
    fields' names in their dests and default flags (prefix="health_": field failure_threshold is
    --health-failure-threshold), so that two nested configs may have fields of the same name."""
    return field(default_factory=cls, metadata={NESTED: Nested(cls, title, prefix)})


def _scalar(hint: Any) -> tuple[type, bool]:
    """(int, float, str or bool; whether repeated) from `X`, `X | None` or `tuple[X, ...]` (a flag
    given once per value)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = tuple(a for a in args if a is not type(None))
        if len(args) != 1:
            raise TypeError(f"a setting must have one type (or None), not {hint}")
        hint = args[0]
    many = typing.get_origin(hint) is tuple
    if many:
        hint = typing.get_args(hint)[0]
    if hint not in (int, float, str, bool):
        raise TypeError(f"a setting is an int, float, str or bool, not {hint}")
    return hint, many


def parse_bool(raw: str) -> bool:
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{raw!r} is not true or false")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


@dataclass(frozen=True)
class _Entry:
    name: str  # the dest: the field's name after its nested configs' prefixes
    kind: type
    many: bool  # repeated: each time adds a value (a tuple field)
    spec: Flag
    default: Any
    env: str | None


def _flag_word(flag: str) -> str:
    """--queue-timeout -> QUEUE_TIMEOUT."""
    return flag.lstrip("-").replace("-", "_").upper()


def settings_of(
    cls: type, env_prefix: str = "", prefix: str = ""
) -> Iterator[tuple[str | None, _Entry]]:
    """(group title or None, entry) for each setting of `cls`, nested configs' included."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        inner = f.metadata.get(NESTED)
        if inner is not None:
            for _, entry in settings_of(inner.cls, env_prefix, prefix + inner.prefix):
                yield inner.title, entry
            continue
        spec = f.metadata.get(SETTING)
        if spec is None:
            continue
        dest = prefix + f.name
        env = spec.env or (env_prefix + _flag_word(spec.names(dest)[0]) if env_prefix else None)
        kind, many = _scalar(hints[f.name])
        yield None, _Entry(dest, kind, many, spec, _default_of(f), env)


def _env_default(entry: _Entry, default: Any) -> tuple[Any, bool]:
    raw = os.environ.get(entry.env) if entry.env else None
    if raw is None:
        return default, False
    try:
        if entry.spec.parse is not None:
            value = entry.spec.parse(raw)
        else:
            value = parse_bool(raw) if entry.kind is bool else entry.kind(raw)
    except ValueError:
        raise SystemExit(
            f"environment variable {entry.env}={raw!r} is not a valid {entry.kind.__name__}"
        ) from None
    choices = entry.spec.choices
    if choices is not None and value not in choices:
        raise SystemExit(
            f"environment variable {entry.env}={raw!r} is not one of {', '.join(map(str, choices))}"
        )
    return value, True


def add_flags(
    ap: argparse.ArgumentParser,
    cls: type,
    *,
    defaults: Mapping[str, Any] | None = None,
    env_prefix: str = "",
) -> None:
    """`cls`'s settings as flags of `ap` (dest: the field's name, after a nested prefix);
    `defaults`: a command's own defaults by dest; `env_prefix`: every setting without an `env` of
    its own reads ENV_PREFIX + its flag's name (e.g. PDSERVE_ROUTER_PORT for --port). TypeError
    where two settings have one dest."""
    defaults = defaults or {}
    groups: dict[str | None, Any] = {None: ap}
    entries = list(settings_of(cls, env_prefix))
    dests = [entry.name for _, entry in entries]
    twice = sorted({d for d in dests if dests.count(d) > 1})
    if twice:
        raise TypeError(
            f"{cls.__name__}: settings share the dest {', '.join(twice)} (a nested prefix tells "
            "them apart)"
        )
    for title, entry in entries:
        if title not in groups:
            groups[title] = ap.add_argument_group(title)
        _add_one(groups[title], entry, defaults.get(entry.name, entry.default))


def _add_one(target: Any, entry: _Entry, default: Any) -> None:
    default, from_env = _env_default(entry, default)
    spec = entry.spec
    names = spec.names(entry.name)
    note = f"; from {entry.env}" if from_env else (f"; env {entry.env}" if entry.env else "")
    kw: dict[str, Any] = {"dest": entry.name, "default": default}
    if entry.kind is bool and spec.parse is None:
        kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
        kw["help"] = f"{spec.help} (default: {'on' if default else 'off'}{note})"
    else:
        kw["type"] = spec.parse or entry.kind
        if entry.many:  # None: not given, the field's default stands (argparse would append to it)
            if entry.env:
                raise TypeError(f"{entry.name}: a repeated setting reads no environment variable")
            kw.update(action="append", default=None)
        shown = "hidden" if spec.secret else "%(default)s"
        kw["help"] = f"{spec.help} (default: {shown}{note})"
        if entry.kind is bool:  # with a parse of its own: `--x`, `--x true`, `--x false`
            kw["nargs"], kw["const"] = "?", True
        if spec.choices is not None:
            kw["choices"] = list(spec.choices)
        if spec.metavar or spec.choices is None:  # after the flag, not the dest: --queue-timeout
            kw["metavar"] = spec.metavar or _flag_word(names[0])  # QUEUE_TIMEOUT
    target.add_argument(*names, **kw)


def config_from_args(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """`cls` from the parsed flags (each field's dest is its name), nested configs included;
    `given`: fields that are no flags, or that the caller derived. ValueError (from the config's
    checks) names what is wrong."""
    return _from_args(cls, args, "", given)


def _from_args(cls: type, args: argparse.Namespace, prefix: str, given: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kw: dict[str, Any] = {}
    for f in fields(cls):
        inner = f.metadata.get(NESTED)
        if f.name in given:
            kw[f.name] = given[f.name]
        elif inner is not None:
            kw[f.name] = _from_args(inner.cls, args, prefix + inner.prefix, {})
        elif SETTING in f.metadata and hasattr(args, prefix + f.name):
            value = getattr(args, prefix + f.name)
            if isinstance(value, list):
                kw[f.name] = tuple(value)
            elif value is not None or not _is_many(hints[f.name]):
                kw[f.name] = value
    return cls(**kw)


def _is_many(hint: Any) -> bool:
    return typing.get_origin(hint) is tuple


def config_from_dict(cls: type, data: Mapping[str, Any]) -> Any:
    """`cls` from `dataclasses.asdict(config)` (a spec crossing to a child process as JSON): nested
    configs rebuilt, tuples restored from lists."""
    hints = typing.get_type_hints(cls)
    kw: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        if NESTED in f.metadata and isinstance(value, Mapping):
            value = config_from_dict(f.metadata[NESTED].cls, value)
        elif isinstance(value, list) and typing.get_origin(hints[f.name]) is tuple:
            value = tuple(value)
        kw[f.name] = value
    unknown = sorted(set(data) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {', '.join(unknown)}")
    return cls(**kw)


def flag_rows(cls: type, env_prefix: str = "") -> list[tuple[str, str, str]]:
    """(flag, its other spellings, its environment variable) for each setting: the docs' table."""
    return [
        (e.spec.names(e.name)[0], ", ".join(e.spec.aliases), e.env or "")
        for _, e in settings_of(cls, env_prefix)
    ]
