"""Command line and `--config FILE`: server flags plus one flag per engine config field (flags win over the file)."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from imp_jax.cli_flags import add_flags
from imp_jax.server.config import ServerConfig, flag_fields
from imp_jax.server.config_file import read_config

SERVER_KEYS = tuple(f.name for f in flag_fields())


def build_parser(engine_config_cls: type) -> argparse.ArgumentParser:
    """Server flags, then `--<field>` for every field of the engine's config dataclass."""
    p = argparse.ArgumentParser(prog="python -m imp_jax.server", description="imp_jax: an LLM inference server",
                                argument_default=argparse.SUPPRESS)
    p.add_argument("--config", type=Path, help="TOML file: keys mirror these flags, or imp's sections ([server], "
                   "[runtime], ...; docs/USAGE.md, Configuration file); flags win")
    add_flags(p.add_argument_group("server"), ServerConfig, flag_fields())
    add_flags(p.add_argument_group("engine"), engine_config_cls, list(dataclasses.fields(engine_config_cls)))
    return p


def parse_config(argv: list[str] | None, engine_config_cls: type) -> ServerConfig:
    """Defaults < the --config file < flags; returns the server config holding the engine's."""
    parser = build_parser(engine_config_cls)
    args = vars(parser.parse_args(argv))
    engine_keys = {f.name for f in dataclasses.fields(engine_config_cls)}
    settings: dict[str, Any] = {}
    config_path = args.pop("config", None)
    if config_path is not None:
        try:
            settings.update(read_config(config_path, set(SERVER_KEYS), engine_keys))
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
