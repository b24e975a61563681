"""`replayllm replay`: a trace file's per-token logprobs (and top-k) as JSONL or parquet, on one engine or on Ray
replicas (entrypoints/distributed/ does the work)."""

from __future__ import annotations

import argparse

from ..distributed.options import add_scale_out_args
from .cli_parser import Subcommands
from .engine_args import add_engine_args_for, engine_kwargs
from .serve_compat_args import add_model_option, resolve_model_option


def add_replay(sub: Subcommands, command: str | None) -> None:
    """`replayllm replay`: a trace file's logprobs, on one engine or Ray replicas."""
    rep = sub.add_parser("replay", help="replay a trace file; write every trace token's logprob, rank (and top-k) "
                                        "as JSONL or parquet, on one engine or on Ray replicas")
    rep.add_argument("model", nargs="?", default=None, help="model dir or id (default: the embedded model)")
    add_model_option(rep)  # vLLM's `--model M`
    rep.add_argument("--traces", required=True, help="trace file (JSONL, see docs/diff.md)")
    rep.add_argument("--out", required=True, help="output file: .jsonl or .parquet (one row per trace token)")
    rep.add_argument("--format", choices=("jsonl", "parquet"), default=None, help="(default: from --out's extension)")
    rep.add_argument("--logprobs", type=int, default=0, metavar="K",
                     help="also write the K most likely tokens per position (default: 0)")
    rep.add_config_arg()
    add_scale_out_args(rep)
    add_engine_args_for(command, rep, "replay")
    rep.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    from ..distributed import replay

    resolve_model_option(args)
    kwargs = engine_kwargs(args)
    kwargs.pop("enable_trace_replay")  # on for every replay (as for `generate --trace`)
    result = replay(args.traces, args.out, model=args.model, logprobs=args.logprobs, format=args.format,
                    data_parallel_size=args.data_parallel_size, ray_address=args.ray_address,
                    shard_size=args.shard_size, progress=True, **kwargs)
    print(f"wrote {result.num_tokens} tokens of {result.num_requests} traces to {result.path} ({result.format}; "
          f"{result.data_parallel_size} replica{'s' if result.data_parallel_size > 1 else ''}"
          + (f", {result.retries} shards retried" if result.retries else "") + f", {result.seconds:.1f} s; "
          f"trace replay {result.resolved.get('trace_replay')})")
    return 0
