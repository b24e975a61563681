"""The CLI generated from EngineConfig: help and choices from the typed fields, "did you mean", `--config FILE.yaml`
(every engine option round-trips), diff SPECs parsed through the same typed path."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

import pytest
import yaml

from replayllm.config import EngineConfig
from replayllm.entrypoints.cli.config_options import config_options
from replayllm.entrypoints.cli.engine_args import engine_kwargs, engine_options
from replayllm.entrypoints.cli.main import build_parser
from replayllm.entrypoints.diff import SpecError, parse_spec

# Subcommands that take engine flags, with the other flags they require.
ENGINE_COMMANDS = {
    ("generate",): {},
    ("serve",): {},
    ("capture",): {"prompts": "p.txt", "out": "t.jsonl"},
    ("bench", "throughput"): {},
    ("bench", "latency"): {},
}
NOT_FLAGS = ("model",)


def _other_value(opt):
    """A value of the option's type other than its default (what a config file would set)."""
    if opt.name == "served_model_name":
        return ["first-name", "second-name"]
    if opt.choices is not None:
        return next(c for c in opt.choices if c != opt.default)
    if opt.kind == "json":
        return {"method": "ngram", "num_speculative_tokens": 2}
    if opt.kind == "bool":
        return not opt.default
    if opt.kind == "int":
        return (opt.default or 0) + 3
    return 0.25 if opt.kind == "float" else f"value-of-{opt.name}"


def _subparsers(parser: argparse.ArgumentParser, path=()):
    """(command path, parser) for every leaf subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, (*path, name))
            return
    yield path, parser


def _parse_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_every_engine_option_has_help_and_a_type():
    opts = [o for o in engine_options() if o.name not in NOT_FLAGS]
    assert {o.name for o in opts} | set(NOT_FLAGS) == set(EngineConfig.option_names())
    assert [o.name for o in engine_options() if not o.offered] == [], \
        "an EngineConfig field of a type the command line cannot spell (list, a union): not a flag"
    assert {o.name: o.kind for o in engine_options() if o.kind == "json"} == {"speculative_config": "json"}
    missing = [o.name for o in opts if not o.help]
    assert not missing, f"EngineConfig fields without a comment (their --help text): {missing}"


def test_help_shows_every_flag_with_help():
    for path, parser in _subparsers(build_parser()):
        undocumented = [a.option_strings or a.dest for a in parser._actions
                        if not isinstance(a, argparse._HelpAction) and not a.help]
        assert not undocumented, (path, undocumented)
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for opt in engine_options():
        if opt.name not in NOT_FLAGS:
            assert opt.flag in text
            assert " ".join(opt.help.split()[:3]) in " ".join(text.split()), opt.name


def test_literal_fields_are_choices(capsys):
    literal = {o.name: o for o in engine_options() if o.choices is not None}
    assert {"dtype", "attention_backend", "load_format", "quantization"} <= set(literal)
    serve_help = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    for opt in literal.values():
        assert opt.metavar in serve_help
    assert build_parser().parse_args(["serve", "--quantization", "none"]).quantization is None
    err = _parse_error(["serve", "--attention-backend", "trito"], capsys)
    assert "argument --attention-backend: invalid choice 'trito'" in err and "did you mean 'triton'?" in err


def test_unknown_flag_names_the_subcommand_and_suggests(capsys):
    err = _parse_error(["serve", "--max-modl-len", "5"], capsys)
    assert "replayllm serve: error: unrecognized arguments: --max-modl-len (did you mean --max-model-len?)" in err
    err = _parse_error(["generate", "--no-enable-prefx-caching"], capsys)
    assert "did you mean --no-enable-prefix-caching?" in err
    assert "did you mean" not in _parse_error(["serve", "--zzzzzz"], capsys)


@pytest.mark.parametrize("command", list(ENGINE_COMMANDS))
def test_config_file_round_trips_every_engine_option(command, tmp_path):
    options = [o for o in engine_options() if o.name not in NOT_FLAGS]
    values = {o.name: _other_value(o) for o in options}
    # Keys as flag names with dashes (vLLM's format) for half of them, underscores for the rest.
    data = {(k.replace("_", "-") if i % 2 else k): v for i, (k, v) in enumerate(values.items())}
    data.update(ENGINE_COMMANDS[command], model="my/model")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    args = build_parser().parse_args([*command, "--config", str(path)])
    got = engine_kwargs(args)
    want = {**values, "served_model_name": values["served_model_name"][0]}
    assert got == want
    assert args.model == "my/model" and args.served_model_name == values["served_model_name"]
    for key, value in ENGINE_COMMANDS[command].items():
        assert getattr(args, key) == value


def test_config_file_types_nulls_and_command_line_override(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_model_len: 256\nquantization: null\nenforce-eager: true\nasync-scheduling: false\n"
                    "allowed-origins: ['https://a.example']\nport: 9000\nenable-log-requests: true\n")
    args = build_parser().parse_args(["serve", "cli/model", "--config", str(path), "--max-model-len", "128",
                                      "--no-enforce-eager"])
    assert (args.max_model_len, args.quantization, args.enforce_eager, args.async_scheduling) == (128, None, False,
                                                                                                   False)
    assert args.allowed_origins == ["https://a.example"] and args.port == 9000 and args.enable_log_requests
    assert args.model == "cli/model" and args.config == str(path)


@pytest.mark.parametrize("text, message", [
    ("max-modl-len: 3\n", "unknown key 'max-modl-len' (did you mean 'max-model-len'?)"),
    ("speculative_config: [1]\n", "argument --speculative-config: expected a JSON object, got '[1]'"),
    ("max-model-len: lots\n",
     "argument --max-model-len: expected an integer or a size such as 4k (4000) or 4K (4096), got 'lots'"),
    ("enforce-eager: 3\n", "enforce-eager must be true or false, got 3"),
    ("- a\n- b\n", "expected a mapping of flag names to values, got list"),
    ("a: [\n", "not valid YAML"),
])
def test_bad_config_files_are_clear_errors(text, message, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert message in _parse_error(["serve", "--config", str(path)], capsys)
    assert "no such file" in _parse_error(["serve", "--config", str(tmp_path / "nope.yaml")], capsys)


def test_diff_specs_parse_engine_options_as_the_flags_do():
    parser = build_parser()
    for opt in engine_options():
        if opt.name in NOT_FLAGS or opt.kind not in ("int", "float", "str", "bool") or opt.name == "served_model_name":
            continue
        value = _other_value(opt)
        text = str(value).lower() if isinstance(value, bool) else str(value)
        flag = [opt.flag] if opt.kind != "bool" else []
        flag = flag + [text] if flag else [opt.flag if value else "--no-" + opt.flag[2:]]
        from_cli = getattr(parser.parse_args(["serve", *flag]), opt.name)
        if opt.name == "enable_trace_replay" and value is False:
            continue  # the diff forces trace replay on
        assert parse_spec(f"{opt.name}={text}").options == {opt.name: from_cli} == {opt.name: value}
    with pytest.raises(SpecError, match="did you mean 'max_model_len'"):
        parse_spec("max_modl_len=4")


@dataclass
class _Future:
    """Stands for an EngineConfig of later: its new fields reach the CLI without CLI changes."""

    mode: Literal["fast", "exact"] = "exact"  # how to do it
    # a longer explanation
    # over two lines
    chunk: int | None = None
    scale: float = 1.0
    """an attribute docstring"""
    pairs: dict | None = None  # a JSON object on the command line
    names: list[str] | None = None  # not spelled on the command line


def test_new_fields_get_help_and_choices_from_their_source():
    opts = {o.name: o for o in config_options(_Future)}
    assert opts["mode"].help == "how to do it" and opts["mode"].choices == ("fast", "exact")
    assert opts["chunk"].help == "a longer explanation over two lines" and opts["chunk"].optional
    assert opts["scale"].help == "an attribute docstring" and opts["scale"].parse("2") == 2.0
    assert opts["chunk"].parse("none") is None
    assert not opts["names"].offered and opts["mode"].offered
    assert opts["pairs"].parse('{"a": 1}') == {"a": 1} and opts["pairs"].parse("none") is None
    with pytest.raises(ValueError, match="expected a JSON object"):
        opts["pairs"].parse("[1, 2]")
    with pytest.raises(ValueError, match="invalid choice 'fas'.*did you mean 'fast'"):
        opts["mode"].parse("fas")


def test_docs_list_every_flag():
    """docs/serving.md lists every engine flag (its table) and every `serve` flag; the README names the
    subcommands."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    serving = (root / "docs" / "serving.md").read_text(encoding="utf-8")
    # The README's workflows and the feature list it points to (docs/features.md) name every subcommand.
    readme = (root / "README.md").read_text(encoding="utf-8") + (root / "docs" / "features.md").read_text("utf-8")
    for opt in engine_options():
        if opt.name not in NOT_FLAGS:
            assert f"`--[no-]{opt.flag[2:]}`" in serving if opt.kind == "bool" else opt.flag in serving, opt.flag
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    engine = {o.name for o in engine_options()}
    for action in serve._actions:
        for flag in ([] if action.dest in engine else action.option_strings):
            if flag.startswith("--") and not flag.startswith("--no-") and flag != "--help":
                assert flag in serving, flag
    for name in ("replayllm generate", "replayllm serve", "replayllm chat", "replayllm complete",
                 "replayllm capture", "replayllm diff", "replayllm rl-demo", "replayllm bench", "--config",
                 "--disable-log-stats"):
        assert name in readme, name
