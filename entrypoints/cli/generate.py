"""`replayllm generate`: one prompt, free generation or a replayed trace, each token's logprob and rank printed."""

from __future__ import annotations

import argparse

from .cli_parser import Subcommands
from .engine_args import add_engine_args_for, engine_kwargs
from .serve_compat_args import add_model_option, resolve_model_option

DEMO_PROMPT = "Once upon a time"
DEMO_TRACE_TEXT = " there lived a curious little robot."


def add_generate(sub: Subcommands, command: str | None) -> None:
    """`replayllm generate`: one prompt, free generation or a replayed trace."""
    gen = sub.add_parser("generate", help="generate from one prompt (greedy by default) or replay a trace on it "
                                          "(--trace, --trace-text, --demo); print each token's logprob and rank")
    gen.add_argument("model", nargs="?", default=None, help="model dir or id (default: the embedded model)")
    add_model_option(gen)  # vLLM's `--model M`
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
    add_engine_args_for(command, gen, "generate")
    gen.set_defaults(func=cmd_generate)


def _token_ids(text: str) -> list[int]:
    """--trace's value: comma-separated token ids (argparse names the flag in the error)."""
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 15,284,11, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {text!r}")
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    from ...outputs import RequestOutput
    from ...sampling_params import SamplingParams
    from ..llm import LLM

    resolve_model_option(args)
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
