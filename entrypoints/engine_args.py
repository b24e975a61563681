"""Engine options on the command line: one flag per EngineConfig option, and back to `LLM` keyword arguments.

Shared by the CLI (entrypoints/cli.py) and the server's `run_server` (entrypoints/api_server.py), which
would otherwise import each other."""

from __future__ import annotations

import argparse
import dataclasses


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig option, named as the LLM keyword with dashes."""
    from ..config import EngineConfig

    for f in dataclasses.fields(EngineConfig):
        if not f.init or f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool, "bool | None"):  # --x / --no-x (None: the engine decides, see EngineConfig)
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name == "speculative_config":
            continue  # not supported yet: not offered on the command line
        elif f.name == "served_model_name":  # vLLM: several names; requests may use any, the first is reported
            parser.add_argument(flag, nargs="+", default=None, metavar="NAME",
                                help="the model name(s) requests use (default: the model argument); responses "
                                     "report the first")
        else:
            conv = int if f.type in ("int", "int | None") else float if "float" in str(f.type) else str
            parser.add_argument(flag, type=conv, default=f.default, help=f"(default: {f.default})")


def engine_kwargs(args: argparse.Namespace) -> dict:
    from ..config import EngineConfig

    kwargs = {name: getattr(args, name) for name in EngineConfig.option_names()
              if name != "model" and hasattr(args, name)}
    if isinstance(kwargs.get("served_model_name"), list):  # --served-model-name A B: the engine knows A
        kwargs["served_model_name"] = kwargs["served_model_name"][0]
    return kwargs
