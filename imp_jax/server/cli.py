"""Command line and `--config FILE`: server flags plus one flag per engine config field (flags win over the file)."""
from __future__ import annotations

import argparse
import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from imp_jax.server.config import ServerConfig, flag_fields

SERVER_KEYS = tuple(f.name for f in flag_fields())


def _scalar_type(hint: Any) -> type:
    """int for `int | None`, and so on; the one non-None member of an optional."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return hint


def _add_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
               fields: list[dataclasses.Field]) -> None:
    """`--<field>` per dataclass field: bools as --x/--no-x, lists repeatable, choices from the metadata."""
    hints = typing.get_type_hints(cls)
    for f in fields:
        kind = _scalar_type(hints[f.name])
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        flag = "--" + f.name.replace("_", "-")
        text = f.metadata.get("help", "")
        text = f"{text} (default {default})" if text else f"default {default}"
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=text)
        elif typing.get_origin(kind) is list:
            p.add_argument(flag, action="append", help=text)
        else:
            p.add_argument(flag, type=kind, choices=f.metadata.get("choices"), help=text)


def build_parser(engine_config_cls: type) -> argparse.ArgumentParser:
    """Server flags, then `--<field>` for every field of the engine's config dataclass."""
    p = argparse.ArgumentParser(prog="python -m imp_jax.server", description="imp_jax: an LLM inference server",
                                argument_default=argparse.SUPPRESS)
    p.add_argument("--config", type=Path, help="TOML file whose keys mirror these flags (flags win)")
    _add_flags(p.add_argument_group("server"), ServerConfig, flag_fields())
    _add_flags(p.add_argument_group("engine"), engine_config_cls, list(dataclasses.fields(engine_config_cls)))
    return p


def read_toml(path: Path, allowed: set[str]) -> dict[str, Any]:
    """A flat TOML config; keys may be spelled with '-' or '_'. Unknown keys are an error."""
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in allowed:
            raise ValueError(f"--config {path}: unknown key {key!r}; known: {', '.join(sorted(allowed))}")
        out[name] = value
    return out


def parse_config(argv: list[str] | None, engine_config_cls: type) -> ServerConfig:
    """Defaults < the --config file < flags; returns the server config holding the engine's."""
    parser = build_parser(engine_config_cls)
    args = vars(parser.parse_args(argv))
    engine_keys = {f.name for f in dataclasses.fields(engine_config_cls)}
    settings: dict[str, Any] = {}
    config_path = args.pop("config", None)
    if config_path is not None:
        try:
            settings.update(read_toml(config_path, engine_keys | set(SERVER_KEYS)))
        except ValueError as e:
            parser.error(str(e))
    settings.update(args)
    try:
        engine = engine_config_cls(**{k: v for k, v in settings.items() if k in engine_keys})
    except (TypeError, ValueError) as e:
        parser.error(f"bad engine setting: {e}")
    try:
        config = ServerConfig(**{k: settings[k] for k in SERVER_KEYS if k in settings}, engine=engine,
                              model_given="model" in settings)
        config.api_keys()  # a missing key file is a start-up error
    except (TypeError, ValueError) as e:
        parser.error(f"bad server setting: {e}")
    return config
