"""The engine's command-line flags, one per setting declared in kvfleet/fleet/engine_settings.py."""

from __future__ import annotations

import argparse
import os

from kvfleet.engine.config import EngineConfig
from kvfleet.fleet.engine_settings import declared, default_of, flag_fields, flag_name, value_type
from kvfleet.fleet.sizes import parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(err)) from err


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    for f in flag_fields():
        meta = declared(f)
        # Read when the parser is built, as before: a token in the environment is the flag's default.
        default = (os.environ.get(meta.env) or default_of(f)) if meta.env else default_of(f)
        kwargs: dict = {"default": default, "help": meta.help}
        if value_type(f) is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif meta.many:
            kwargs["nargs"] = "+"
        elif meta.size:
            kwargs["type"] = _size
        elif meta.choices:
            kwargs["choices"] = meta.choices
        elif value_type(f) is not str:
            kwargs["type"] = value_type(f)
        g.add_argument(flag_name(f), **kwargs)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name, default_of(f)) for f in flag_fields()})
