"""`replayllm rl-demo`: a runnable GRPO loop (replayllm.rl) on a toy reward. The engine samples, a transformers copy
of the same weights trains, its new weights go back into the engine; one line per step with the reward, the loss
and the trainer-vs-sampler logprob mismatch (docs/rl.md, "The loop: a runnable GRPO example").

The one file of entrypoints/ that imports the roof (rl.py), lazily, when the command runs (docs/architecture.md)."""

from __future__ import annotations

import argparse
import random

from .cli_parser import Subcommands
from .engine_args import add_engine_args_for, engine_kwargs

TRAINER_DTYPES = ("float32", "bfloat16", "float16")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="model dir or id (default: the embedded model)")
    parser.add_argument("--model", dest="model_flag", default=None, metavar="DIR",
                        help="the same as MODEL; a folder with only a config.json (the 0.6B shape of `replayllm "
                             "bench`) runs with random weights: the trainer's seeded initialisation, copied into "
                             "the engine (load_format=dummy) before the first step")
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps (default: 5)")
    parser.add_argument("--num-prompts", type=int, default=4, help="random token-id prompts, drawn once from --seed "
                                                                    "and used every step (default: 4)")
    parser.add_argument("--prompt-len", type=int, default=8, help="tokens per prompt (default: 8)")
    parser.add_argument("--n", type=int, default=4, help="rollouts per prompt, the GRPO group (default: 4)")
    parser.add_argument("--max-tokens", type=int, default=16, help="most tokens per rollout (default: 16)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature (default: 1; the engine reports raw logprobs, so only at 1 are the "
                             "importance ratio and the KL estimate exact)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate (default: 1e-3)")
    parser.add_argument("--trainer-dtype", choices=TRAINER_DTYPES, default="float32",
                        help="the transformers model's dtype (default: float32; the engine's is --dtype)")
    parser.add_argument("--threshold", type=float, default=0.1, help="share of tokens with |delta| above this "
                                                                      "(default: 0.1)")
    parser.add_argument("--save-rollouts", default=None, metavar="PATH",
                        help="write every rollout as a trace file with the sampler's logprobs (replayllm diff "
                             "--traces PATH --a file --b SPEC)")


def even_token_reward(prompt: list[int], completion: list[int]) -> float:
    """The demo's reward, a toy computable from token ids alone: the share of completion tokens whose id is even.
    GRPO should raise it step by step; it means nothing about text."""
    return sum(1 for t in completion if t % 2 == 0) / len(completion)


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    import torch

    from ...config import ModelConfig
    from ...embedded_model import DEFAULT_MODEL
    from ..bench.workload import TOKEN_ID_RANGE
    from ..llm import LLM
    from ..rl import grpo_step, save_rollouts

    _check(args)
    if args.model and args.model_flag and args.model != args.model_flag:
        raise ValueError(f"two models given: {args.model!r} and --model {args.model_flag!r}")
    model = args.model or args.model_flag
    path = ModelConfig.from_pretrained(model or DEFAULT_MODEL).path
    random_weights = not _has_weights(path)
    kwargs = dict(engine_kwargs)
    kwargs.update(enable_trace_replay=True, skip_tokenizer_init=True)  # score() replays; prompts are token ids
    if kwargs.get("max_model_len") is None:  # small KV cache: the trainer shares the device
        kwargs["max_model_len"] = args.prompt_len + args.max_tokens
    if random_weights and kwargs.get("load_format", "auto") == "auto":
        kwargs["load_format"] = "dummy"  # replaced by the trainer's weights before the first step

    with LLM(model, **kwargs) as llm:
        config = llm.llm_engine.config
        device = config.torch_device
        trainer = _trainer(path, random_weights, getattr(torch, args.trainer_dtype), device, config.seed)
        optimizer = torch.optim.Adam(trainer.parameters(), lr=args.lr)
        llm.load_weights(trainer)  # the loop's invariant: the engine holds the trainer's weights
        rng = random.Random(config.seed)
        lo, hi = TOKEN_ID_RANGE[0], min(TOKEN_ID_RANGE[1], config.model_config.vocab_size)
        side = "replayllm.score (batch-invariant: the sampler's own bits)" if config.batch_invariant else \
            "transformers teacher forcing"
        print(f"rl-demo: {config.model or DEFAULT_MODEL} ({'random weights, ' if random_weights else ''}engine "
              f"{str(config.model_config.dtype).removeprefix('torch.')} on {device}, batch_invariant="
              f"{config.batch_invariant}); trainer {args.trainer_dtype}, its logprobs from {side}")
        print(f"{args.num_prompts} prompts x {args.n} rollouts, <= {args.max_tokens} tokens, temperature "
              f"{args.temperature:g}, Adam lr {args.lr:g}; reward: share of even token ids (a toy)")
        # The same prompts every step (a one-batch data set): a step's numbers differ from the last one's only by
        # the weights and the sampling draws.
        prompts = [[rng.randrange(lo, hi) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
        records = []
        for step in range(args.steps):
            rec = grpo_step(llm, trainer, optimizer, prompts, even_token_reward, n=args.n,
                            temperature=args.temperature, max_tokens=args.max_tokens, step=step,
                            threshold=args.threshold)
            records.append(rec)
            m = rec.mismatch
            loss = rec.loss + 0.0  # -0.0 (all advantages 0) prints as +0
            print(f"step {step:>3}  reward {rec.mean_reward:.4f}  loss {loss:+.4e}  mean|Δ| {m.mean_abs:.3e}  "
                  f"max|Δ| {m.max_abs:.3e}  KL {m.kl:.3e}  share>{m.threshold:g} {m.share_above:.4f}  "
                  f"({m.num_tokens} tokens, {rec.seconds:.1f} s)", flush=True)
        if args.save_rollouts:
            n = save_rollouts(args.save_rollouts, records, llm)
            print(f"wrote {n} rollouts to {args.save_rollouts} (the sampler's logprobs; compare: replayllm diff "
                  f"--traces {args.save_rollouts} --a file --b SPEC)")
    return 0


def _check(args: argparse.Namespace) -> None:
    for name in ("steps", "num_prompts", "prompt_len", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.n < 2:
        raise ValueError(f"--n must be >= 2 (GRPO normalises rewards within a prompt's group), got {args.n}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")


def _has_weights(path: str) -> bool:
    """Whether the checkpoint folder holds weights the loader reads, safetensors or PyTorch .bin (a config-only
    folder: random weights)."""
    from ...model_runner_v2.loader import has_weight_files

    return has_weight_files(path)


def _trainer(path: str, random_weights: bool, dtype, device, seed: int):
    """The trainer: the checkpoint's transformers causal LM, or, for a config-only folder, transformers' own
    initialisation of that config from `seed` (normal, the config's initializer_range), in `dtype` on `device`."""
    import torch
    import transformers

    from ...config import ModelConfig
    from ..diff.sides import load_hf_model

    if not random_weights:
        mc = ModelConfig.from_pretrained(path, dtype=str(dtype).removeprefix("torch."))
        return load_hf_model(mc, device)
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device(device):  # initialise where it trains (a 0.6B model initialises slowly on a CPU)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype).eval()


def add_rl_demo(sub: Subcommands, command: str | None) -> None:
    """`replayllm rl-demo`: the GRPO loop."""
    rl = sub.add_parser("rl-demo", help="a runnable GRPO loop on a toy reward: the engine samples, a transformers "
                                         "copy trains, its weights go back; per step the trainer-vs-sampler mismatch")
    add_cli_args(rl)
    rl.add_config_arg()
    add_engine_args_for(command, rl, "rl-demo")
    rl.set_defaults(func=cmd_rl_demo)


def cmd_rl_demo(args: argparse.Namespace) -> int:
    return main(args, engine_kwargs(args))
