"""`replayllm` command line: generate (the demo), serve (OpenAI-compatible server), chat and complete (its
clients), capture, diff and replay (traces), rl-demo (a GRPO loop), bench (throughput, latency, serve)."""

from __future__ import annotations

import argparse
import sys

from ..distributed.options import add_scale_out_args
from .chat_client_args import add_client_args
from .cli_parser import CLIParser
from .connection_limits import add_connection_args
from .engine_args import add_engine_args, engine_kwargs
from .limits import add_limit_args
from .rl_demo import add_cli_args as add_rl_demo_args
from .serve_compat_args import add_compat_args, add_model_option, resolve_model_option
from .server_args import add_server_args
from .tokenizer_pool_args import add_tokenizer_pool_args

DEMO_PROMPT = "Once upon a time"
DEMO_TRACE_TEXT = " there lived a curious little robot."
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process stopped by Ctrl-C
_Subcommands = argparse._SubParsersAction  # what add_subparsers returns: each add_parser is a CLIParser
_CONSOLE_FLIPS = 5  # argmax flips listed by `replayllm diff` (summary.md lists more, diff.json all)


def cmd_generate(args: argparse.Namespace) -> int:
    from ..entrypoints.llm import LLM
    from ..outputs import RequestOutput
    from ..sampling_params import SamplingParams

    replay = args.demo or args.trace is not None or args.trace_text is not None
    if replay and (args.temperature is not None or args.max_tokens is not None):
        raise ValueError("--temperature and --max-tokens are for free generation; a replayed trace (--trace, "
                         "--trace-text, --demo) sets every token")
    kwargs = engine_kwargs(args)
    if replay:
        kwargs["enable_trace_replay"] = True
    llm = LLM(args.model, **kwargs)
    tok = llm.get_tokenizer()
    prompt = args.prompt or DEMO_PROMPT
    if replay:
        trace_token_ids = args.trace
        # --trace-text, or the demo: read the model's opinion of each token of a fixed sentence
        if trace_token_ids is None:
            trace_token_ids = tok.encode(args.trace_text or DEMO_TRACE_TEXT, add_special_tokens=False)
        params = SamplingParams(trace_decode_token_ids=trace_token_ids, logprobs=args.logprobs)
    else:
        params = SamplingParams(temperature=0.0 if args.temperature is None else args.temperature,
                                max_tokens=16 if args.max_tokens is None else args.max_tokens,
                                logprobs=args.logprobs)
    out: RequestOutput = llm.generate([prompt], params, use_tqdm=False)[0]
    comp = out.outputs[0]
    print(f"prompt: {prompt!r} ({len(out.prompt_token_ids)} tokens)")
    if replay:
        print(f"replayed {len(comp.token_ids)} trace tokens; finish_reason={comp.finish_reason}")
    else:
        print(f"generated {len(comp.token_ids)} tokens (temperature {params.temperature:g}); "
              f"finish_reason={comp.finish_reason}")
    print(f"{'pos':>3}  {'token':>7}  {'text':<14} {'logprob':>9}  {'rank':>6}  top-1 alternative")
    for i, (token, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
        chosen = lps[token]
        best = min(lps.items(), key=lambda kv: kv[1].rank)
        print(f"{i:>3}  {token:>7}  {chosen.decoded_token!r:<14} {chosen.logprob:>9.4f}  {chosen.rank:>6}  "
              f"{best[1].decoded_token!r} ({best[1].logprob:.4f})")
    print(f"text: {comp.text!r}")
    print(f"sum of {'forced' if replay else 'token'} logprobs: {comp.cumulative_logprob:.4f}")
    return 0


def _token_ids(text: str) -> list[int]:
    """--trace's value: comma-separated token ids (argparse names the flag in the error)."""
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 15,284,11, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {text!r}")
    return ids


def cmd_serve(args: argparse.Namespace) -> int:
    from .server_main import run_server

    return run_server(args)


def cmd_client(args: argparse.Namespace) -> int:
    from .chat_client import main as client_main

    return client_main(args, args.chat)


def cmd_capture(args: argparse.Namespace) -> int:
    from ..diff import capture_run, read_prompts, write_traces
    from ..distributed.options import scale_out_from_args

    kwargs = engine_kwargs(args)
    kwargs["max_logprobs"] = max(kwargs["max_logprobs"], args.top_k)
    scale_out = scale_out_from_args(args)
    if scale_out.uses_ray:
        from ..distributed.sharded import capture_to_file

        prompts = read_prompts(args.prompts)
        with _bar(len(prompts), "Captured") as bar:
            n, tokens = capture_to_file(prompts, args.out, scale_out, model=args.model, max_tokens=args.max_tokens,
                                        temperature=args.temperature, top_k=args.top_k, on_request=bar.update,
                                        **kwargs)
        print(f"wrote {n} traces ({tokens} tokens) to {args.out} ({scale_out.data_parallel_size} replicas)")
        return 0
    run = capture_run(read_prompts(args.prompts), model=args.model, max_tokens=args.max_tokens,
                      temperature=args.temperature, top_k=args.top_k, progress=True, **kwargs)
    records = run.records
    write_traces(args.out, records, provenance=run.provenance)
    print(f"wrote {len(records)} traces ({sum(len(r.trace_token_ids) for r in records)} tokens) to {args.out}")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from ..diff import compare, write_report
    from ..diff.export import parse_export_formats
    from ..diff.report import flip_line, headline
    from ..diff.resolved import describe

    formats = parse_export_formats(args.export)  # before anything runs: a bad format costs no engine start
    result = compare(args.traces, args.a, args.b, model=args.model, full_vocab=args.full_vocab, top_k=args.top_k,
                     threshold=args.threshold, batch_size=args.batch_size, noise_factor=args.noise_factor,
                     localize=args.localize, trace_replay_chunk_size=args.trace_replay_chunk_size, progress=True,
                     data_parallel_size=args.data_parallel_size, ray_address=args.ray_address,
                     fix_routes=args.fix_routes)
    files = write_report(result, args.out, export=formats)
    o = result.overall
    print(f"A: {result.a}  vs  B: {result.b}  ({len(result.requests)} requests, {o.num_tokens} tokens)")
    for line in headline(result):
        print(line)
    for flip in result.flips[:_CONSOLE_FLIPS]:
        print(f"  flip: {flip_line(flip)}")
    if len(result.flips) > _CONSOLE_FLIPS:
        print(f"  ... {len(result.flips) - _CONSOLE_FLIPS} more flips in {files.summary}")
    for name, facts in (("A", result.resolved_a), ("B", result.resolved_b)):
        print(f"{name} resolved: {describe(facts) or facts.get('source', '')}")
    print(f"report: {files.html}  {files.summary}  {files.json}")
    if files.exports:
        print("export: " + "  ".join(str(p) for p in files.exports))
    if args.fail_above is not None and o.max_abs_delta > args.fail_above:
        worst = result.worst(1)[0]
        print(f"FAIL: max |delta| = {o.max_abs_delta:.6g} > --fail-above {args.fail_above:g} "
              f"(request {worst.request_id!r}, position {worst.position}, token {worst.token})", file=sys.stderr)
        return 1
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from ..distributed import replay

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


def cmd_rl_demo(args: argparse.Namespace) -> int:
    from .rl_demo import main as rl_demo_main

    return rl_demo_main(args, engine_kwargs(args))


def _bar(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI; with `command` (the first word of argv), engine flags only on that subcommand: they import
    EngineConfig (torch, seconds), which `chat`, `complete` and `--help` do not need."""
    from .. import __version__

    parser = CLIParser(prog="replayllm", description=__doc__)
    parser.add_argument("-V", "--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)  # each a CLIParser: --config, "did you mean"
    _add_generate(sub, command)
    _add_serve(sub, command)
    _add_clients(sub)
    _add_capture(sub, command)
    _add_diff(sub)
    _add_replay(sub, command)
    _add_rl_demo(sub, command)
    _add_bench(sub, command)
    return parser


def _engine_args(command: str | None, parser: argparse.ArgumentParser, name: str) -> None:
    """The engine flags on subcommand `name`, unless the command line runs another one (see build_parser)."""
    if command is None or command == name:
        add_engine_args(parser)


def _add_generate(sub: _Subcommands, command: str | None) -> None:
    """`replayllm generate`: one prompt, free generation or a replayed trace."""
    gen = sub.add_parser("generate", help="generate from one prompt (greedy by default) or replay a trace on it "
                                          "(--trace, --trace-text, --demo); print each token's logprob and rank")
    gen.add_argument("model", nargs="?", default=None, help="model dir or id (default: the embedded model)")
    gen.add_argument("--prompt", default=None, help=f"(default: {DEMO_PROMPT!r})")
    replay = gen.add_mutually_exclusive_group()
    replay.add_argument("--trace", type=_token_ids, default=None, metavar="IDS",
                        help="replay these comma-separated token ids")
    replay.add_argument("--trace-text", default=None, help="replay the tokens of this text")
    replay.add_argument("--demo", action="store_true", help=f"replay the demo sentence {DEMO_TRACE_TEXT!r}")
    gen.add_argument("--max-tokens", type=int, default=None, help="free generation: tokens to generate "
                                                                  "(default: 16)")
    gen.add_argument("--temperature", type=float, default=None, help="free generation: 0 is greedy (default); "
                                                                     "--seed seeds sampling")
    gen.add_argument("--logprobs", type=int, default=5, help="alternatives per token (default: 5)")
    gen.add_config_arg()
    _engine_args(command, gen, "generate")
    gen.set_defaults(func=cmd_generate)


def _add_serve(sub: _Subcommands, command: str | None) -> None:
    """`replayllm serve`: the HTTP server's flags (server_main.run_server reads them)."""
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default=None, help="model dir or id (default: the embedded model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    serve.add_argument("--api-key", default=None, help="require this bearer key (or env REPLAYLLM_API_KEY)")
    serve.add_argument("--enable-log-requests", action="store_true",
                       help="log each request's id and sizes (never its text)")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="do not log the engine's stats line every 10 s (throughput, requests, KV cache)")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's log level (default: info)")
    serve.add_config_arg()
    add_server_args(serve)
    add_compat_args(serve)
    add_limit_args(serve)
    add_connection_args(serve)
    add_tokenizer_pool_args(serve)
    _engine_args(command, serve, "serve")
    serve.set_defaults(func=cmd_serve)


def _add_clients(sub: _Subcommands) -> None:
    """`replayllm chat` and `replayllm complete`: clients of a running server."""
    for name, chat in (("chat", True), ("complete", False)):
        client = sub.add_parser(name, help=f"{'chat' if chat else 'complete prompts'} with a running server "
                                           f"(interactive, or one --quick message)")
        add_client_args(client, chat)
        client.set_defaults(func=cmd_client, chat=chat)


def _add_capture(sub: _Subcommands, command: str | None) -> None:
    """`replayllm capture`: prompts -> a trace file."""
    cap = sub.add_parser("capture", help="generate completions for prompts; write them as a trace file with the "
                                         "engine's logprobs")
    cap.add_argument("model", nargs="?", default=None, help="model dir or id (default: the embedded model)")
    cap.add_argument("--prompts", required=True, help=".txt (one prompt per line) or .jsonl (prompt / "
                                                      "prompt_token_ids [+ id] per line)")
    cap.add_argument("--out", required=True, help="trace file to write (JSONL)")
    cap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt (default: 64)")
    cap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); --seed seeds sampling")
    cap.add_argument("--top-k", type=int, default=5, help="alternatives stored per token (top_logprobs); 0: none")
    cap.add_config_arg()
    add_scale_out_args(cap)
    _engine_args(command, cap, "capture")
    cap.set_defaults(func=cmd_capture)


def _add_diff(sub: _Subcommands) -> None:
    """`replayllm diff`: two sides' logprobs on the same traces (its engine options are SPECs)."""
    diff = sub.add_parser("diff", help="replay traces on two sides (engine configs, transformers, the trace "
                                       "file) and report per-token logprob differences")
    diff.add_argument("model", nargs="?", default=None, help="model dir or id (default: the embedded model)")
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


def _add_replay(sub: _Subcommands, command: str | None) -> None:
    """`replayllm replay`: a trace file's logprobs, on one engine or Ray replicas."""
    rep = sub.add_parser("replay", help="replay a trace file; write every trace token's logprob, rank (and top-k) "
                                        "as JSONL or parquet, on one engine or on Ray replicas")
    rep.add_argument("model", nargs="?", default=None, help="model dir or id (default: the embedded model)")
    rep.add_argument("--traces", required=True, help="trace file (JSONL, see docs/diff.md)")
    rep.add_argument("--out", required=True, help="output file: .jsonl or .parquet (one row per trace token)")
    rep.add_argument("--format", choices=("jsonl", "parquet"), default=None, help="(default: from --out's extension)")
    rep.add_argument("--logprobs", type=int, default=0, metavar="K",
                     help="also write the K most likely tokens per position (default: 0)")
    rep.add_config_arg()
    add_scale_out_args(rep)
    _engine_args(command, rep, "replay")
    rep.set_defaults(func=cmd_replay)


def _add_rl_demo(sub: _Subcommands, command: str | None) -> None:
    """`replayllm rl-demo`: the GRPO loop."""
    rl = sub.add_parser("rl-demo", help="a runnable GRPO loop on a toy reward: the engine samples, a transformers "
                                         "copy trains, its weights go back; per step the trainer-vs-sampler mismatch")
    add_rl_demo_args(rl)
    rl.add_config_arg()
    _engine_args(command, rl, "rl-demo")
    rl.set_defaults(func=cmd_rl_demo)


def _add_bench(sub: _Subcommands, command: str | None) -> None:
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
        _engine_args(command, p, "bench")
        p.set_defaults(func=cmd_bench)
    p = bench_sub.add_parser("serve", help="stream random prompts (or trace replays) through a running server: "
                                           "TTFT, TPOT, ITL, throughput (vLLM's bench serve)")
    _bench_module("serve").add_cli_args(p)
    p.set_defaults(func=cmd_bench)


def _bench_module(name: str):
    from .bench import latency, serve, throughput

    return {"throughput": throughput, "latency": latency, "serve": serve}[name]


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":  # a client of a running server: no engine here
        return _bench_module("serve").main(args)
    resolve_model_option(args)
    return _bench_module(args.bench_command).main(args, engine_kwargs(args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback (LLM.generate aborted its requests already)
        print("interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
