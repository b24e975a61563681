"""`replayllm bench throughput|latency|serve`: the benchmarks of entrypoints/bench/ (docs/benchmarks.md)."""

from __future__ import annotations

import argparse

from .cli_parser import Subcommands
from .engine_args import add_engine_args_for, engine_kwargs
from .serve_compat_args import add_model_option, resolve_model_option


def add_bench(sub: Subcommands, command: str | None) -> None:
    """`replayllm bench throughput|latency|serve`."""
    bench = sub.add_parser("bench", help="benchmarks: offline throughput, latency; serving (docs/benchmarks.md)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, help_text in (("throughput", "N prompts x (input + output) tokens through LLM.generate, greedy or "
                                           "replaying traces; output tok/s and the roofline fraction"),
                            ("latency", "time to first token and per output token of a small batch")):
        p = bench_sub.add_parser(name, help=help_text)
        p.add_argument("model", nargs="?", default=None,
                       help="model dir or id (default: a Qwen3-0.6B-shaped config with dummy weights)")
        add_model_option(p)
        _bench_module(name).add_cli_args(p)
        p.add_config_arg()
        add_engine_args_for(command, p, "bench")
        p.set_defaults(func=cmd_bench)
    p = bench_sub.add_parser("serve", help="stream random prompts (or trace replays) through a running server: "
                                           "TTFT, TPOT, ITL, throughput (vLLM's bench serve)")
    _bench_module("serve").add_cli_args(p)
    p.set_defaults(func=cmd_bench)


def _bench_module(name: str):
    from ..bench import latency, serve, throughput

    return {"throughput": throughput, "latency": latency, "serve": serve}[name]


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":  # a client of a running server: no engine here
        return _bench_module("serve").main(args)
    resolve_model_option(args)
    return _bench_module(args.bench_command).main(args, engine_kwargs(args))
