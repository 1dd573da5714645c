"""Command-line flags generated from the frozen config dataclasses.

Each field of an option group becomes a flag (`kv_cache_gib` -> `--kv-cache-gib`) with its type,
default and help text (`metadata["help"]`, `metadata["choices"]`); `build_group` and
`config_from_args` build the dataclasses back from the parsed namespace. Used by `cairn.cli` (generate,
serve) and `cairn.bench.cli`; it parses nothing itself and knows no subcommand.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from cairn.config import EngineConfig, environment_defaults


def _field_type(f: dataclasses.Field, owner: type):
    hint = typing.get_type_hints(owner)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = args[0]
    return hint


def _help_text(f: dataclasses.Field, default) -> str:
    """The field's help with its default appended, unless the help already states it or there is none."""
    text = f.metadata.get("help", "")
    if default is None or "default:" in text or "by default" in text:
        return text
    shown = ("on" if default else "off") if isinstance(default, bool) else default
    return f"{text} (default: {shown})"


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str, exclude: frozenset = frozenset(),
                       defaults: dict | None = None) -> None:
    """One flag per field of `cls` (minus `exclude`); `defaults` replaces field defaults for this parser."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _field_type(f, cls)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        default = (defaults or {}).get(f.name, default)
        help_text = _help_text(f, default).replace("%", "%%")
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=kind, default=default, choices=f.metadata.get("choices"),
                               help=help_text)


def build_group(cls: type, ns: argparse.Namespace):
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})


def engine_group_classes() -> dict[str, type]:
    return {name: _field_type(f, EngineConfig) for name, f in ((f.name, f) for f in dataclasses.fields(EngineConfig))}


def add_engine_args(parser: argparse.ArgumentParser, exclude: frozenset = frozenset(),
                    defaults: dict | None = None) -> None:
    """The engine's flags; `--cpu-isa` defaults to the CAIRN_CPU_ISA environment variable where it is set."""
    defaults = {**environment_defaults(), **(defaults or {})}
    for name, cls in engine_group_classes().items():
        add_dataclass_args(parser, cls, f"{name} options", exclude, defaults)


def config_from_args(ns: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: build_group(cls, ns) for name, cls in engine_group_classes().items()})
