"""`replayllm capture`: prompts -> a trace file with the engine's logprobs, on one engine or on Ray replicas."""

from __future__ import annotations

import argparse

from ..distributed.options import add_scale_out_args
from .cli_parser import Subcommands
from .engine_args import add_engine_args_for, engine_kwargs
from .serve_compat_args import add_model_option, resolve_model_option


def add_capture(sub: Subcommands, command: str | None) -> None:
    """`replayllm capture`: prompts -> a trace file."""
    cap = sub.add_parser("capture", help="generate completions for prompts; write them as a trace file with the "
                                         "engine's logprobs")
    cap.add_argument("model", nargs="?", default=None, help="model dir or id (default: the embedded model)")
    add_model_option(cap)  # vLLM's `--model M`
    cap.add_argument("--prompts", required=True, help=".txt (one prompt per line) or .jsonl (prompt / "
                                                      "prompt_token_ids [+ id] per line)")
    cap.add_argument("--out", required=True, help="trace file to write (JSONL)")
    cap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt (default: 64)")
    cap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); --seed seeds sampling")
    cap.add_argument("--top-k", type=int, default=5, help="alternatives stored per token (top_logprobs); 0: none")
    cap.add_config_arg()
    add_scale_out_args(cap)
    add_engine_args_for(command, cap, "capture")
    cap.set_defaults(func=cmd_capture)


def cmd_capture(args: argparse.Namespace) -> int:
    from ..diff import capture_run, read_prompts, write_traces
    from ..diff.capture import check_out_file
    from ..distributed.options import scale_out_from_args

    resolve_model_option(args)
    check_out_file(args.out)  # before generating: a bad --out costs no engine time
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


def _bar(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True)
