"""Engine options on the command line: one flag per EngineConfig option, generated from its typed fields, and
back to `LLM` keyword arguments.

Shared by the subcommands (entrypoints/cli/*.py) and the server's `run_server` (cli/server_main.py)."""

from __future__ import annotations

import argparse
from functools import cache

from .config_options import ConfigOption, config_options

_POSITIONAL = "model"  # MODEL, the subcommands' positional argument


@cache
def engine_options() -> tuple[ConfigOption, ...]:
    """EngineConfig's options as the CLI, --config files and diff SPECs see them (help from the field comments,
    choices from Literal types)."""
    from ...config import EngineConfig

    return tuple(config_options(EngineConfig))


def engine_flags() -> list[ConfigOption]:
    """The options that are flags: all but MODEL and those of a type text cannot spell (none today; a dict
    option such as speculative_config is a JSON object)."""
    return [opt for opt in engine_options() if opt.name != _POSITIONAL and opt.offered]


def _arg_type(option: ConfigOption):
    """argparse's `type=`: the option's own parsing, its ValueError reported as argparse's (names the flag)."""
    def parse(text: str):
        try:
            return option.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = option.kind  # argparse's "invalid <name> value" fallback
    return parse


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig option, named as the LLM keyword with dashes: bools are --x / --no-x, Literal
    types are choices, `X | None` takes `none`. The help is the field's comment in config.py."""
    group = parser.add_argument_group("engine options", "EngineConfig, as LLM(...) takes them (docs/serving.md)")
    for opt in engine_flags():
        help_text = (opt.help + (f" (default: {opt.default})" if opt.default is not None else "")).replace("%", "%%")
        if opt.name == "served_model_name":  # vLLM: several names; requests may use any, the first is reported
            group.add_argument(opt.flag, nargs="+", default=None, metavar="NAME",
                               help="the model name(s) requests use (default: the model argument); responses "
                                    "report the first")
        elif opt.name == "tensor_parallel_size":  # vLLM's short alias -tp too
            group.add_argument("-tp", opt.flag, type=_arg_type(opt), default=opt.default, metavar=opt.metavar,
                               help=help_text)
        elif opt.kind == "bool":  # None (async_scheduling): the engine decides, see EngineConfig
            group.add_argument(opt.flag, action=argparse.BooleanOptionalAction, default=opt.default,
                               help=help_text)
        else:
            group.add_argument(opt.flag, type=_arg_type(opt), default=opt.default, metavar=opt.metavar,
                               help=help_text)


def add_engine_args_for(command: str | None, parser: argparse.ArgumentParser, name: str) -> None:
    """The engine flags on subcommand `name`, unless the command line runs another one (see main.build_parser)."""
    if command is None or command == name:
        add_engine_args(parser)


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {opt.name: getattr(args, opt.name) for opt in engine_flags() if hasattr(args, opt.name)}
    if isinstance(kwargs.get("served_model_name"), list):  # --served-model-name A B: the engine knows A
        kwargs["served_model_name"] = kwargs["served_model_name"][0]
    return kwargs
