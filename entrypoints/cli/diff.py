"""`replayllm diff`: two sides' logprobs on the same traces, reported per token (entrypoints/diff/ does the work)."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import warnings

from ..distributed.options import add_scale_out_args
from .cli_parser import Subcommands
from .serve_compat_args import add_model_option, resolve_model_option

_CONSOLE_FLIPS = 5  # argmax flips listed by `replayllm diff` (summary.md lists more, diff.json all)


def add_diff(sub: Subcommands) -> None:
    """`replayllm diff`: two sides' logprobs on the same traces (its engine options are SPECs)."""
    diff = sub.add_parser("diff", help="replay traces on two sides (engine configs, transformers, the trace "
                                       "file) and report per-token logprob differences")
    diff.add_argument("model", nargs="?", default=None, help="model dir or id (default: the embedded model)")
    add_model_option(diff)  # vLLM's `--model M`
    diff.add_argument("--traces", required=True, help="trace file (JSONL, see docs/diff.md)")
    diff.add_argument("--a", required=True, metavar="SPEC", help="side A: engine options 'k=v,k=v', 'default', "
                                                                  "'hf[:dtype=...]' or 'file'")
    diff.add_argument("--b", required=True, metavar="SPEC", help="side B (same forms as --a)")
    diff.add_argument("--out", default=None, help="report folder (default: a new diff-YYYYmmdd-HHMMSS here)")
    diff.add_argument("--full-vocab", action="store_true", help="exact KL over the whole vocabulary (both sides "
                                                                 "keep [V] float32 per position)")
    diff.add_argument("--top-k", type=int, default=20, help="alternatives read per position (argmax agreement, "
                                                             "KL estimate) (default: 20)")
    diff.add_argument("--threshold", type=float, default=1e-3, help="|delta| above this is a divergence "
                                                                     "(default: 1e-3)")
    diff.add_argument("--noise-factor", type=float, default=10.0, metavar="K",
                      help="a position stands out of the run's noise when |delta| > K x the run's median |delta| "
                           "(default: 10)")
    diff.add_argument("--localize", type=int, default=0, metavar="N",
                      help="run up to N positions (argmax flips first, then the largest |delta|) again on both sides "
                           "with hooks on every decoder layer and name the first layer where they part (default: 0, "
                           "off)")
    diff.add_argument("--export", action="append", default=None, metavar="FORMAT",
                      help="also write one row per scored position as positions.FORMAT: parquet, csv or jsonl "
                           "(repeat the flag or give a comma list; parquet needs pyarrow: replayllm[parquet])")
    diff.add_argument("--fix-routes", choices=("a", "b"), default=None,
                      help="MoE models: replay side A's expert routes on side B (b: B's on A), so the diff shows "
                           "the numerical mismatch alone (the forced side must be an engine)")
    diff.add_argument("--fail-above", type=float, default=None, metavar="X", help="exit 1 when max |delta| > X")
    diff.add_argument("--batch-size", type=int, default=32, help="requests per engine batch (default: 32)")
    diff.add_argument("--trace-replay-chunk-size", type=int, default=None, metavar="K",
                      help="trace tokens replayed per step on both engine sides, unless a SPEC sets "
                           "trace_replay_chunk_size itself (default: the engine's: one token per step, fast replay in "
                           "batch-invariant mode)")
    diff.add_config_arg()
    add_scale_out_args(diff, shard_size=False)
    diff.set_defaults(func=cmd_diff)


def cmd_diff(args: argparse.Namespace) -> int:
    from ..diff import compare, write_report
    from ..diff.export import parse_export_formats
    from ..diff.report_files import make_out_dir, remove_if_empty

    resolve_model_option(args)
    formats = parse_export_formats(args.export)  # before anything runs: a bad format costs no engine start
    _check_fail_above(args.fail_above)
    created = args.out is None or not os.path.exists(args.out)
    directory = make_out_dir(args.out)  # a bad --out is found before the sides run, not after
    try:
        with _one_line_warnings():
            result = compare(args.traces, args.a, args.b, model=args.model, full_vocab=args.full_vocab,
                             top_k=args.top_k, threshold=args.threshold, batch_size=args.batch_size,
                             noise_factor=args.noise_factor, localize=args.localize,
                             trace_replay_chunk_size=args.trace_replay_chunk_size, progress=True,
                             data_parallel_size=args.data_parallel_size, ray_address=args.ray_address,
                             fix_routes=args.fix_routes)
    except BaseException:
        if created:  # no empty report folder left behind by a run that wrote nothing
            remove_if_empty(directory)
        raise
    files = write_report(result, directory, export=formats)
    _print_summary(result, files)
    return _gate(result, args.fail_above)


def _check_fail_above(x: float | None) -> None:
    """NaN would compare False with every |delta| and silently turn the CI gate off."""
    if x is not None and not (math.isfinite(x) and x >= 0):
        raise ValueError(f"--fail-above must be a finite number >= 0, got {x!r}")


@contextlib.contextmanager
def _one_line_warnings():
    """The diff's own warnings (DiffWarning) as one `warning: ...` line on stderr; others as Python prints them."""
    from ..diff.job import DiffWarning

    with warnings.catch_warnings():
        warnings.simplefilter("always", DiffWarning)  # every run warns, not only a process's first
        show = warnings.showwarning

        def one_line(message, category, *rest, **kwargs):
            if issubclass(category, DiffWarning):
                print(f"warning: {message}", file=sys.stderr)
            else:
                show(message, category, *rest, **kwargs)

        warnings.showwarning = one_line  # catch_warnings restores it
        yield


def _print_summary(result, files) -> None:
    from ..diff.report import flip_line, headline
    from ..diff.resolved import describe

    o = result.overall
    print(f"A: {result.a}  vs  B: {result.b}  ({len(result.requests)} requests, {o.num_tokens} tokens)")
    for line in headline(result):
        print(line)
    for flip in result.flips[:_CONSOLE_FLIPS]:
        print(f"  flip: {flip_line(flip)}")
    if len(result.flips) > _CONSOLE_FLIPS:  # summary.md's table stops at 50: diff.json holds them all
        print(f"  ... {len(result.flips) - _CONSOLE_FLIPS} more flips in {files.json}")
    for name, facts in (("A", result.resolved_a), ("B", result.resolved_b)):
        print(f"{name} resolved: {describe(facts) or facts.get('source', '')}")
    print(f"report: {files.html}  {files.summary}  {files.json}")
    if files.exports:
        print("export: " + "  ".join(str(p) for p in files.exports))


def _gate(result, fail_above: float | None) -> int:
    """--fail-above: exit 1 when max |delta| exceeds it."""
    o = result.overall
    if fail_above is not None and o.max_abs_delta > fail_above:
        worst = result.worst(1)[0]
        print(f"FAIL: max |delta| = {o.max_abs_delta:.6g} > --fail-above {fail_above:g} "
              f"(request {worst.request_id!r}, position {worst.position}, token {worst.token})", file=sys.stderr)
        return 1
    return 0
