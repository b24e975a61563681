"""One check shared by the MoE architectures whose transformers router returns (logits, weights, ids): the routes
the engine reports against the experts transformers' router chose, then replayed bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from replayllm import LLM, SamplingParams


def _gate_ids(hf, layer: int) -> tuple[torch.nn.Module, Callable]:
    return hf.model.layers[layer].mlp.gate, lambda out: out[2]


def assert_routes_match_transformers_and_replay(llm: LLM, hf, dense_layers: tuple[int, ...],
                                                sparse_layers: tuple[int, ...], router=_gate_ids) -> None:
    """`llm` built with enable_return_routed_experts=True on `hf`'s checkpoint. A sampled completion's routes:
    -1 on the dense layers, transformers' chosen ids on the sparse ones as sets (near-ties may flip under rounding:
    > 95% agree); replaying them (trace_routed_experts) gives the same logprobs and routes. router(hf, layer) ->
    (the module whose forward hook sees the choice, its output -> ids [T, k]): mlp.gate's third output by
    default."""
    prompt = torch.randint(3, 300, (14,), generator=torch.Generator().manual_seed(8)).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=1.0, seed=3, max_tokens=9,
                                                                      ignore_eos=True, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    routes = out.routed_experts  # [P + 8, layers, k]
    assert all((routes[:, layer] == -1).all() for layer in dense_layers)
    chosen = {}
    hooks = []
    for i in sparse_layers:
        module, ids_of = router(hf, i)
        hooks.append(module.register_forward_hook(lambda _m, _x, y, i=i, f=ids_of: chosen.__setitem__(i, f(y))))
    try:
        with torch.no_grad():
            hf(torch.tensor([prompt + out.token_ids[:-1]]))
    finally:
        for h in hooks:
            h.remove()
    theirs = np.sort(torch.stack([chosen[i] for i in sparse_layers], dim=1).numpy(), axis=-1)  # [T, sparse, k]
    assert (np.sort(routes[:, list(sparse_layers)], axis=-1) == theirs).mean() > 0.95
    replay = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        trace_decode_token_ids=out.token_ids, trace_replay_chunk_size=1, logprobs=1, trace_routed_experts=routes),
        use_tqdm=False)[0].outputs[0]
    lps = [[d[t].logprob for t, d in zip(c.token_ids, c.logprobs)] for c in (out, replay)]
    assert lps[0] == lps[1] and np.array_equal(replay.routed_experts, routes)
