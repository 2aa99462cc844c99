"""Command-line flags generated from the frozen config dataclasses, and back.

add_flags(parser, Config) adds one flag per field (nested dataclasses flattened), typed from
the annotation, named `--field-name` unless the field's metadata says "flag", with help text
and choices from the metadata. from_args(Config, namespace) builds the config (so
__post_init__ validates it); to_argv(config) writes the flags that reproduce it, which is how
`tessera serve` hands its settings to the worker and gateway it starts. A field added to a
config later gets its flag everywhere that config is used, with no edit here.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import re
import types
import typing
from typing import Any, Iterator

Names = dict[str, str]          # field name -> flag, for configs whose metadata we do not own


@dataclasses.dataclass(frozen=True)
class _Flag:
    field: dataclasses.Field
    flag: str
    kind: type                  # the element type (int, float, str, bool)
    many: bool                  # tuple[T, ...]: a repeatable flag
    optional: bool              # T | None

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


def _unwrap(hint) -> tuple[Any, bool, bool]:
    """(element type, many, optional) of a field's annotation."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0] if len(args) == 1 else hint
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0], True, optional
    return hint, False, optional


def _flags(cls: type, names: Names | None, exclude) -> Iterator[tuple[tuple[str, ...], _Flag | type]]:
    """(field path, flag) for each settable field; a nested config yields (path, its class)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude or not f.init:
            continue
        kind, many, optional = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(kind):
            yield (f.name,), kind
        elif kind in (int, float, str, bool):
            flag = (names or {}).get(f.name) or f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            yield (f.name,), _Flag(f, flag, kind, many, optional)
        # other types (mappings, callables) are not set from the command line


@functools.cache
def _comments(cls: type) -> dict[str, str]:
    """Field name -> its trailing `# comment` in the class source: the help of configs whose
    fields carry no metadata."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    found = (re.match(r"\s+(\w+)\s*:[^#]*#\s*(.+)$", line) for line in lines)
    return {m[1]: m[2].strip() for m in found if m}


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def add_flags(parser: argparse.ArgumentParser, cls: type, names: Names | None = None,
              helps: dict[str, str] | None = None, exclude=()) -> None:
    """One flag per field of cls (and of the configs nested in it)."""
    for _, spec in _flags(cls, names, exclude):
        if not isinstance(spec, _Flag):
            add_flags(parser, spec, names, helps, exclude)
            continue
        f, default = spec.field, _default(spec.field)
        text = (f.metadata.get("help") or (helps or {}).get(f.name) or _comments(cls).get(f.name)
                or f"{cls.__name__}.{f.name}")
        if default not in (None, (), False):
            text += f" (default: {','.join(map(str, default)) if spec.many else default})"
        kwargs: dict[str, Any] = {"dest": spec.dest, "help": text.replace("%", "%%")}
        if spec.kind is bool:
            kwargs.update(action=argparse.BooleanOptionalAction, default=default)
        elif spec.many:
            kwargs.update(action="append", type=spec.kind, default=None)
        else:
            kwargs.update(type=spec.kind, default=default, choices=f.metadata.get("choices"))
        parser.add_argument(spec.flag, **kwargs)


def from_args(cls: type, args: argparse.Namespace, names: Names | None = None, exclude=(),
              helps=None, **given):
    """The config the parsed flags describe; `given` overrides fields (e.g. derived ones)."""
    values = dict(given)
    for (name,), spec in _flags(cls, names, exclude):
        if name in values:
            continue
        if not isinstance(spec, _Flag):
            values[name] = from_args(spec, args, names, exclude)
        elif hasattr(args, spec.dest):
            value = getattr(args, spec.dest)
            if spec.many:
                value = _default(spec.field) if value is None else tuple(value)
            values[name] = value
    return cls(**values)


def to_argv(config, names: Names | None = None, exclude=(), helps=None) -> list[str]:
    """Flags that make from_args() rebuild `config` (fields left at their default are omitted)."""
    argv: list[str] = []
    for (name,), spec in _flags(type(config), names, exclude):
        value = getattr(config, name)
        if not isinstance(spec, _Flag):
            argv += to_argv(value, names, exclude)
        elif value != _default(spec.field):
            if spec.kind is bool:
                argv.append(spec.flag if value else "--no-" + spec.flag[2:])
            elif value is None:
                raise ValueError(f"{spec.flag}: None cannot be written as a flag")
            else:
                argv += [a for v in (value if spec.many else (value,)) for a in (spec.flag, str(v))]
    return argv
