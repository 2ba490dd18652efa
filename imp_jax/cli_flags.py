"""argparse flags made from dataclass fields: one `--<field>` each, so a config or parameter set has one definition."""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any


def scalar_type(hint: Any) -> Any:
    """int for `int | None`, and so on; the one non-None member of an optional."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return hint


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, fields: list[dataclasses.Field],
              helps: dict[str, str] | None = None, defaults: dict[str, Any] | None = None) -> None:
    """`--<field>` per dataclass field: bools as --x/--no-x, lists repeatable (of their element type), choices
    from the metadata; help from the field's metadata, else `helps`; the default shown: `defaults`', else the field's."""
    hints = typing.get_type_hints(cls)
    for f in fields:
        kind = scalar_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        text = f.metadata.get("help") or (helps or {}).get(f.name, "")
        default = (defaults or {}).get(f.name, field_default(f))
        text = f"{text} (default {default})" if text else f"default {default}"
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=text)
        elif typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind) or (str,)
            p.add_argument(flag, action="append", type=item, help=text + "; repeatable")
        else:
            p.add_argument(flag, type=kind, choices=f.metadata.get("choices"), help=text)
