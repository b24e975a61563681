"""`replayllm serve --tokenizer-pool-size / --tokenizer-pool-queue`: the API server's tokenizer pool."""

from __future__ import annotations

import argparse

from ...engine.tokenizer_pool import TokenizerPoolConfig, default_pool_size
from ..http.limits import positive_int


def add_tokenizer_pool_args(parser: argparse.ArgumentParser) -> None:
    default = TokenizerPoolConfig()
    parser.add_argument("--tokenizer-pool-size", type=positive_int, default=None, metavar="N",
                        help="worker threads that tokenize and render chat templates, in each of the two lanes "
                             f"(small inputs, large inputs) (default: min(4, CPUs) = {default_pool_size()})")
    parser.add_argument("--tokenizer-pool-queue", type=positive_int, default=default.max_queued, metavar="N",
                        help="large inputs (at least "
                             f"{default.small_input_chars} characters or body bytes) being tokenized or waiting "
                             f"at once; one more is a 503 'server busy' (default: {default.max_queued})")


def tokenizer_pool_from_args(args: argparse.Namespace) -> TokenizerPoolConfig:
    size = getattr(args, "tokenizer_pool_size", None)
    return TokenizerPoolConfig(max_queued=getattr(args, "tokenizer_pool_queue", TokenizerPoolConfig.max_queued),
                               **({} if size is None else {"size": size}))
