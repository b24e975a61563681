"""CLIParser: argparse with vLLM's `--config FILE.yaml` (flags read from a file, the command line wins) and a
"did you mean" suggestion for an unknown flag."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from .config_options import closest

Subcommands = argparse._SubParsersAction  # what add_subparsers returns: each add_parser is a CLIParser
CONFIG_FLAG = "--config"
# Set on the namespace when the file names the model and the command line does not (the positional MODEL).
_MODEL_KEY = "model"


class CLIParser(argparse.ArgumentParser):
    """A subcommand's parser: `--config FILE` expands to the flags the file holds, placed before the command
    line's own (so these override it); unknown flags are an error of this subcommand, with a suggestion."""

    def add_config_arg(self) -> None:
        self.add_argument(CONFIG_FLAG, default=None, metavar="FILE.yaml",
                          help="read flags from this YAML file (vLLM's format: `flag-name: value`, dashes or "
                               "underscores); flags on the command line override it")

    def parse_known_args(self, args=None, namespace=None):
        args = list(args) if args is not None else None
        model = None
        if args is not None and self._has_config_arg():
            args, model = self._expand_config(args)
        namespace, extras = super().parse_known_args(args, namespace)
        if model is not None and getattr(namespace, _MODEL_KEY, None) is None:
            setattr(namespace, _MODEL_KEY, model)
        if extras and not self._has_subparsers():
            self.error(self._unrecognized(extras))
        return namespace, extras

    def error(self, message: str):
        """The message and where to read more (the full usage of an engine subcommand is 40 lines), exit 2."""
        self.exit(2, f"{self.prog}: error: {message}\n(see '{self.prog} --help')\n")

    def _has_config_arg(self) -> bool:
        return CONFIG_FLAG in self._option_string_actions

    def _has_subparsers(self) -> bool:
        return any(isinstance(a, argparse._SubParsersAction) for a in self._actions)

    def _flags(self) -> list[str]:
        return [s for s in self._option_string_actions if s.startswith("--")]

    def _unrecognized(self, extras: list[str]) -> str:
        text = f"unrecognized arguments: {' '.join(extras)}"
        flags = [e.split("=", 1)[0] for e in extras if e.startswith("--")]
        hint = closest(flags[0], self._flags()) if flags else None
        return text + (f" (did you mean {hint}?)" if hint else "")

    def _expand_config(self, args: list[str]) -> tuple[list[str], Any]:
        """[..., --config F, ...] -> [flags of F, ..., --config F, ...] and the file's `model` (or None)."""
        path = None
        for i, arg in enumerate(args):
            if arg == CONFIG_FLAG and i + 1 < len(args):
                path = args[i + 1]
            elif arg.startswith(CONFIG_FLAG + "="):
                path = arg.split("=", 1)[1]
        if path is None:
            return args, None
        values = self._read_config(path)
        model = values.pop(_MODEL_KEY, None)
        return self._config_to_args(path, values) + args, model

    def _read_config(self, path: str) -> dict[str, Any]:
        import yaml

        if not os.path.isfile(path):
            self.error(f"{CONFIG_FLAG} {path}: no such file")
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            self.error(f"{CONFIG_FLAG} {path}: not valid YAML: {e}")
        if data is None:
            return {}
        if not isinstance(data, dict):
            self.error(f"{CONFIG_FLAG} {path}: expected a mapping of flag names to values, got "
                       f"{type(data).__name__}")
        return {str(k).replace("_", "-"): v for k, v in data.items()}

    def _config_to_args(self, path: str, values: dict[str, Any]) -> list[str]:
        """The file's {flag-name: typed value} as command-line tokens, typed as the flag's action takes them."""
        out: list[str] = []
        for key, value in values.items():
            flag = "--" + key
            action = self._option_string_actions.get(flag)
            if action is None or flag == CONFIG_FLAG:
                hint = closest(key, [s[2:] for s in self._flags() if s != CONFIG_FLAG])
                self.error(f"{CONFIG_FLAG} {path}: unknown key {key!r}"
                           + (f" (did you mean {hint!r}?)" if hint else ""))
            if isinstance(action, argparse.BooleanOptionalAction):
                if value is not None:  # null: leave the default (the engine decides)
                    out.append(flag if _bool(path, key, value, self) else "--no-" + key)
            elif action.nargs == 0:  # store_true
                if _bool(path, key, value, self):
                    out.append(flag)
            elif action.nargs in ("+", "*") and isinstance(value, list):
                out += [flag, *(str(v) for v in value)]
            elif isinstance(value, (list, dict)):
                out += [flag, json.dumps(value)]  # JSON-list flags (--allowed-origins)
            elif value is None:
                out += [flag, "none"]
            elif isinstance(value, bool):
                out += [flag, str(value).lower()]
            else:
                out += [flag, str(value)]
        return out


def _bool(path: str, key: str, value: Any, parser: argparse.ArgumentParser) -> bool:
    if not isinstance(value, bool):
        parser.error(f"{CONFIG_FLAG} {path}: {key} must be true or false, got {value!r}")
    return value
