"""score(): teacher-forced logprobs with the engine's replay bits as values and the trainer model's gradients."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..sampling_params import RequestOutputKind, SamplingParams
from .llm import LLM


def score(llm: LLM, model: nn.Module, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], *,
          sync_weights: bool = True) -> list[torch.Tensor]:
    """Teacher-forced logprobs of each (prompt_token_ids, completion_token_ids) pair, differentiable in `model`.

    llm: an `LLM(..., batch_invariant=True, enable_trace_replay=True)` on the same architecture as `model`.
    model: the trainer's transformers causal LM (HF parameter names; any dtype; `model(input_ids,
      attention_mask=...).logits`).
    Returns one float32 tensor [len(completion)] per pair, on `model`'s device: element i is the logprob of
    completion[i] given prompt + completion[:i].

    Values: exactly the bits the engine reports when it replays the completion as a trace after the prompt (its
    forward in batch-invariant mode, so they do not depend on how the engine batched the call); with the engine in
    bf16 and `model` in fp32 they are the bf16 sampler's numbers (the RL case). Gradients: those of `model`'s own
    log_softmax, added as a zero (`exact + (ref - ref.detach())`), so `loss.backward()` trains `model` on the numbers
    the sampler saw. Costs one engine replay plus one forward of `model`.
    sync_weights: first copy `model`'s current weights into the engine (in place; CUDA graphs stay valid) and drop
      the engine's prefix cache, whose KV was computed with the old weights. False: the caller keeps them equal."""
    pairs = _check(llm, sequences)
    if sync_weights:
        load_weights(llm, model)
    params = [SamplingParams(trace_decode_token_ids=completion, logprobs=0, detokenize=False,
                             output_kind=RequestOutputKind.FINAL_ONLY) for _, completion in pairs]
    outs = llm.generate([{"prompt_token_ids": prompt} for prompt, _ in pairs], params, use_tqdm=False)
    device = next(model.parameters()).device
    refs = reference_logprobs(model, pairs, device)
    results = []
    for out, ref in zip(outs, refs):
        exact = torch.tensor(out.outputs[0].logprobs.columns().logprobs, dtype=torch.float32, device=device)
        # ref - ref.detach() is +0.0 wherever ref is finite, so the sum keeps exact's bits; -inf - -inf is nan: 0.
        results.append(exact + torch.nan_to_num(ref - ref.detach(), nan=0.0))
    return results


def load_weights(llm: LLM, model: nn.Module) -> None:
    """Copy `model`'s weights (HF names) into the engine in place (LLM.load_weights: CUDA graphs stay valid, the
    prefix cache is dropped)."""
    if llm.llm_engine.has_unfinished_requests():
        raise ValueError("score: the engine has unfinished requests; their KV would mix old and new weights")
    llm.load_weights(model)


def _check(llm: LLM, sequences) -> list[tuple[list[int], list[int]]]:
    config = llm.llm_engine.config
    if not config.batch_invariant or not config.enable_trace_replay:
        raise ValueError("score needs LLM(..., batch_invariant=True, enable_trace_replay=True): its values are the "
                         "engine's replay bits, which depend on the batch unless batch_invariant is on")
    pairs = []
    for i, pair in enumerate(sequences):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(
                isinstance(part, Sequence) and not isinstance(part, str) for part in pair):
            raise ValueError(f"sequences[{i}] must be a (prompt_token_ids, completion_token_ids) pair of id lists")
        prompt, completion = list(pair[0]), list(pair[1])
        if not prompt or not completion:
            raise ValueError(f"sequences[{i}]: prompt and completion must each hold at least one token id")
        if len(prompt) + len(completion) > config.max_model_len:
            raise ValueError(f"sequences[{i}]: {len(prompt)} + {len(completion)} tokens exceed max_model_len="
                             f"{config.max_model_len}")
        pairs.append((prompt, completion))
    if not pairs:
        raise ValueError("sequences is empty: give at least one (prompt_token_ids, completion_token_ids) pair")
    return pairs


def reference_logprobs(model: nn.Module, pairs: list[tuple[list[int], list[int]]],
                       device: torch.device) -> list[torch.Tensor]:
    """model's float32 log_softmax at each completion token: one right-padded batch (padding after a sequence
    cannot change its causal positions), [len(completion)] per pair, with autograd. Plain transformers teacher
    forcing (also the trainer side of replayllm.rl outside batch-invariant mode)."""
    lens = [len(p) + len(c) for p, c in pairs]
    ids = torch.zeros(len(pairs), max(lens), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, (prompt, completion) in enumerate(pairs):
        ids[row, : lens[row]] = torch.tensor(prompt + completion, device=device)
        mask[row, : lens[row]] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits  # [B, T, V]
    # Every completion token's row in one gather, [tokens, V]: its backward writes one [B, T, V] gradient, where
    # a slice per pair wrote (and summed) one per pair (16 pairs on the embedded model's 152k vocabulary, CPU: a
    # backward 10x slower).
    # Row j of pair i is position len(prompt_i) - 1 + j, which predicts completion_i[j].
    batch_idx = torch.cat([torch.full((len(c),), i, dtype=torch.long) for i, (_, c) in enumerate(pairs)])
    pos_idx = torch.cat([torch.arange(len(p) - 1, len(p) - 1 + len(c)) for p, c in pairs])
    targets = torch.tensor([t for _, c in pairs for t in c], device=device)[:, None]  # [tokens, 1]
    rows = logits[batch_idx.to(device), pos_idx.to(device)].float().log_softmax(-1)  # [tokens, V]
    return list(rows.gather(1, targets)[:, 0].split([len(c) for _, c in pairs]))
