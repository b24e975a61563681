"""`replayllm bench serve`'s requests: random prompts (token ids, or with --text-prompts the text they decode
to, as vLLM's random dataset sends) and their /v1/completions bodies (--backend openai-chat: /v1/chat/completions
bodies, each prompt's text as one user message), drawn from --seed."""

from __future__ import annotations

import argparse
import json
import os
import random

from .workload import TOKEN_ID_RANGE

# --backend: the route each drives by default (vllm: vLLM's alias of openai)
BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def check_backend(args: argparse.Namespace) -> None:
    """--endpoint from --backend when not given; a chat backend needs a chat route and a tokenizer (its prompts
    are text): --tokenizer, else --model when it names a local folder (vLLM's default tokenizer is the model)."""
    chat = args.backend == "openai-chat"
    if args.endpoint is None:
        args.endpoint = BACKENDS[args.backend]
    if chat != args.endpoint.rstrip("/").endswith("chat/completions"):
        want = "a chat/completions route" if chat else "a completions route, not a chat one (--backend openai-chat)"
        raise ValueError(f"--backend {args.backend} streams through {want}; got --endpoint {args.endpoint}")
    if chat and not args.tokenizer:
        if not (args.model and os.path.isdir(args.model)):
            raise ValueError("--backend openai-chat sends each prompt as text: name --tokenizer (or --model as a "
                             "local folder)")
        args.tokenizer = args.model


def load_tokenizer(args: argparse.Namespace):
    """--tokenizer's tokenizer (ValueError when it cannot be loaded), None without the flag."""
    if not args.tokenizer:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(args.tokenizer)
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer {args.tokenizer!r} cannot be loaded: {e}") from e


def vocab_size(args: argparse.Namespace, tokenizer) -> int:
    """The ids' upper bound: --vocab-size, the tokenizer's, --model's config.json (a local folder), or Qwen3's."""
    if args.vocab_size is not None:
        return args.vocab_size
    if tokenizer is not None:
        return len(tokenizer)
    config = os.path.join(args.model or "", "config.json")
    if args.model and os.path.isfile(config):
        with open(config) as f:
            return int(json.load(f)["vocab_size"])
    return TOKEN_ID_RANGE[1]


def _length(rng: random.Random, length: int, ratio: float) -> int:
    """length, or with --random-range-ratio R a uniform draw from [length x (1-R), length x (1+R)] (at least 1)."""
    if ratio == 0:
        return length
    return max(1, rng.randint(int(length * (1 - ratio)), int(length * (1 + ratio))))


def make_bodies(args: argparse.Namespace, model: str) -> list[dict]:
    """One /v1/completions body per prompt, drawn from --seed (ids in [100, vocab) when the vocab allows). With
    --text-prompts the prompt is the text its ids decode to: the server then tokenizes every prompt (what a
    vLLM client's random dataset costs it), and the prompt's length in tokens is the server's count (usage)."""
    tokenizer = load_tokenizer(args)
    chat = args.backend == "openai-chat"
    if args.text_prompts and tokenizer is None:
        raise ValueError("--text-prompts decodes the random ids with --tokenizer: name the tokenizer folder")
    vocab = vocab_size(args, tokenizer)
    rng = random.Random(args.seed)
    lo = TOKEN_ID_RANGE[0] if vocab > 2 * TOKEN_ID_RANGE[0] else 0
    hi = min(vocab, TOKEN_ID_RANGE[1])
    bodies = []
    ratio = args.random_range_ratio
    for _ in range(args.num_prompts):
        input_len = _length(rng, args.random_input_len, ratio)
        output_len = _length(rng, args.random_output_len, ratio)
        ids = [rng.randrange(lo, hi) for _ in range(input_len)]
        body = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
        if chat:  # the user message's text (the chat template adds its tokens: the server's usage counts them)
            body["messages"] = [{"role": "user", "content": tokenizer.decode(ids)}]
        else:
            body["prompt"] = tokenizer.decode(ids) if args.text_prompts else ids
        if args.trace:
            body["trace_decode_token_ids"] = [rng.randrange(lo, hi) for _ in range(output_len)]
            body.update(dict(logprobs=True, top_logprobs=1) if chat else dict(logprobs=1))
        else:
            body.update(temperature=0, ignore_eos=bool(args.ignore_eos))
            body["max_completion_tokens" if chat else "max_tokens"] = output_len
        bodies.append(body)
    return bodies
