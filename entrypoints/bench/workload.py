"""The benchmark workloads: random token-id prompts on a model (by default a Qwen3-0.6B-shaped config with
dummy weights), greedy or replaying a random trace; shared by `replayllm bench`, bench/ scripts and GPU tests."""

from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import dataclass

# Qwen3-0.6B's config.json (no weights: used with load_format="dummy", or randomly initialised for --compare-hf).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645,
}
TOKEN_ID_RANGE = (100, 150_000)  # random ids avoid the lowest and the special tokens of a Qwen-sized vocab


def check_output_path(flag: str, path: str) -> None:
    """A result file's folder exists and is writable (checked before the run: its numbers are not lost after)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path!r}: the folder {folder!r} does not exist or is not writable")


def write_dummy_config(root: str | None = None) -> str:
    """A folder holding only the Qwen3-0.6B config.json (a new temporary folder unless root is given)."""
    path = root or tempfile.mkdtemp(prefix="qwen3-0.6b-dummy-")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(QWEN3_0_6B, f)
    return path


@dataclass(frozen=True)
class Workload:
    """num_prompts random prompts of input_len token ids, each generating output_len tokens: greedy with
    ignore_eos, or (trace=True) replaying a random trace of output_len tokens. logprobs: per generated token
    (None: 1 with a trace, none without)."""

    num_prompts: int
    input_len: int
    output_len: int
    trace: bool = False
    logprobs: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def num_logprobs(self) -> int | None:
        return (1 if self.trace else None) if self.logprobs is None else self.logprobs

    def requests(self, vocab_size: int):
        """(prompts as {"prompt_token_ids": [...]}, one SamplingParams per prompt), drawn from the seed."""
        from ...sampling_params import SamplingParams

        lo, hi = TOKEN_ID_RANGE[0], min(TOKEN_ID_RANGE[1], vocab_size)
        rng = random.Random(self.seed)
        prompts = [{"prompt_token_ids": [rng.randrange(lo, hi) for _ in range(self.input_len)]}
                   for _ in range(self.num_prompts)]
        if self.trace:
            params = [SamplingParams(trace_decode_token_ids=[rng.randrange(lo, hi) for _ in range(self.output_len)],
                                     logprobs=self.num_logprobs) for _ in prompts]
        else:
            params = [SamplingParams(temperature=0, max_tokens=self.output_len, ignore_eos=True,
                                     logprobs=self.num_logprobs)] * len(prompts)
        return prompts, params


def dummy_trace_case(seed: int, prompt_lens, trace_len: int = 32, low: int = 100, high: int = 150_000):
    """(model dir, prompts, traces) for the Qwen3-0.6B dummy model: one random prompt per length, then one random
    trace of trace_len tokens per prompt, ids in [low, high), drawn from random.Random(seed) in that order."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(low, high) for _ in range(n)] for n in prompt_lens]
    traces = [[rng.randrange(low, high) for _ in range(trace_len)] for _ in prompts]
    return write_dummy_config(), prompts, traces


def cuda_ms(fn, reps: int = 20) -> float:
    """Mean milliseconds of fn() on the current CUDA stream (one warm-up call first)."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps
