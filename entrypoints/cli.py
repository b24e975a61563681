"""`replayllm` command line: generate (the demo), serve (OpenAI-compatible server)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

DEMO_PROMPT = "Once upon a time"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig option, named as the LLM keyword with dashes."""
    from ..engine.config import EngineConfig

    for f in dataclasses.fields(EngineConfig):
        if not f.init or f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name == "speculative_config":
            continue  # not supported yet: not offered on the command line
        else:
            conv = int if f.type in ("int", "int | None") else float if "float" in str(f.type) else str
            parser.add_argument(flag, type=conv, default=f.default, help=f"(default: {f.default})")


def engine_kwargs(args: argparse.Namespace) -> dict:
    from ..engine.config import EngineConfig

    return {name: getattr(args, name) for name in EngineConfig.option_names()
            if name != "model" and hasattr(args, name)}


def cmd_generate(args: argparse.Namespace) -> int:
    from ..engine.outputs import RequestOutput
    from ..entrypoints.llm import LLM
    from ..sampling.params import SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    tok = llm.get_tokenizer()
    prompt = args.prompt or DEMO_PROMPT
    if args.demo or args.trace is None:
        # The demo: replay a fixed sentence as the "completion" and read the model's opinion of each token.
        trace_text = args.trace_text or " there lived a curious little robot."
        trace = tok.encode(trace_text, add_special_tokens=False)
    else:
        trace = [int(t) for t in args.trace.split(",")]
    params = SamplingParams(trace_decode_token_ids=trace, logprobs=args.logprobs)
    out: RequestOutput = llm.generate([prompt], params, use_tqdm=False)[0]
    comp = out.outputs[0]
    print(f"prompt: {prompt!r} ({len(out.prompt_token_ids)} tokens)")
    print(f"replayed {len(comp.token_ids)} trace tokens; finish_reason={comp.finish_reason}")
    print(f"{'pos':>3}  {'token':>7}  {'text':<14} {'logprob':>9}  {'rank':>6}  top-1 alternative")
    for i, (token, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
        forced = lps[token]
        best = min(lps.items(), key=lambda kv: kv[1].rank)
        print(f"{i:>3}  {token:>7}  {forced.decoded_token!r:<14} {forced.logprob:>9.4f}  {forced.rank:>6}  "
              f"{best[1].decoded_token!r} ({best[1].logprob:.4f})")
    print(f"text: {comp.text!r}")
    print(f"sum of forced logprobs: {comp.cumulative_logprob:.4f}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .api_server import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replayllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="replay a trace on one prompt and print each token's logprob/rank")
    gen.add_argument("model", nargs="?", default=None, help="model dir or id (default: the embedded model)")
    gen.add_argument("--prompt", default=None)
    gen.add_argument("--trace", default=None, help="comma-separated token ids to replay")
    gen.add_argument("--trace-text", default=None, help="text whose tokens are replayed")
    gen.add_argument("--demo", action="store_true", help="the built-in demo trace")
    gen.add_argument("--logprobs", type=int, default=5)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default=None, help="model dir or id (default: the embedded model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require this bearer key (or env REPLAYLLM_API_KEY)")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
