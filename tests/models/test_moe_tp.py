# ruff: noqa: F811 -- `moe` is the checkpoints fixture imported from test_moe.py, so test arguments "redefine" it
"""Qwen3-MoE, Mixtral, OLMoE and Qwen2-MoE under tensor parallelism (issue 30, docs/moe.md), CPU (gloo, two
processes): every rank holds every expert with half its width, the block's output is all-reduced. The TP=2
engine's logprobs against transformers' forward, its routes against transformers' top-k, checkpoint loading in
both HF layouts (per-expert tensors from disk, transformers' stacked tensors through LLM.load_weights), dummy
weights equal to TP=1's model.

One TP=2 engine is alive at a time (one torch.distributed group per process); each costs a worker start-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.hf_reference import teacher_forced
from helpers.tolerances import LOGPROB_TOL
from helpers.trace_replay_common import DEVICE
from test_moe import _hf_model, _hf_routes, _prompt, _tol, moe  # noqa: F401  (moe: the checkpoints fixture)

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig
from replayllm.model_runner_v2.models.parallel import checkpoint_piece, full_to_local

pytestmark = pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.device_count() < 2,
                                reason="tensor_parallel_size=2 on CUDA needs 2 GPUs (this CPU run covers it)")


def _engine(path: str, tp: int, **kw) -> LLM:
    return LLM(path, device=DEVICE, dtype="float32", skip_tokenizer_init=True, max_model_len=128, block_size=4,
               enable_trace_replay=True, tensor_parallel_size=tp, **kw)


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float], np.ndarray]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True), use_tqdm=False)
    return [(o.outputs[0].token_ids, [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
             o.outputs[0].routed_experts) for o in outs]


def _close(llm: LLM) -> None:
    llm.llm_engine.shutdown()


def test_tp2_matches_transformers_and_loads_both_layouts(moe, tmp_path):
    path, hf = moe["norm"]  # 3 layers (1 dense), 8 experts of width 32, top-2
    prompts = [_prompt(n, 60 + n) for n in (6, 15)]
    llm = _engine(path, 2, enable_return_routed_experts=True)
    try:
        experts = llm.llm_engine.runner.model.model.layers[0].mlp.experts
        assert experts.intermediate_size == 16 and tuple(experts.gate_up_proj.shape) == (8 * 32, 64)
        first = _run(llm, prompts)
        for prompt, (tokens, lps, routes) in zip(prompts, first):
            lp, ids = teacher_forced(hf, prompt, tokens)
            tol = _tol(lp, hf.config.num_hidden_layers)
            assert (torch.tensor(lps) - lp[torch.arange(len(ids)), ids]).abs().max().item() <= tol
            mc = llm.llm_engine.model_config
            hf_ids, margins = _hf_routes(hf, prompt + tokens[:-1])
            clear = margins > 1e-4
            assert clear.mean() > 0.9 and (routes[:, list(mc.moe_layers)] == hf_ids)[clear].all()
            assert (routes[:, 1] == -1).all()
        # Another model's weights: transformers' stacked tensors through load_weights (each rank cuts its
        # part of every expert), then the per-expert tensors of its checkpoint on disk.
        other = _hf_model("norm", seed=1)
        other_path = tmp_path / "other"
        other.save_pretrained(str(other_path), safe_serialization=True)
        assert llm.load_weights(other) > 0
        stacked = _run(llm, prompts)
        llm.llm_engine.update_weights_from_disk(str(other_path))
        from_disk = _run(llm, prompts)
    finally:
        _close(llm)
    assert [t for t, _, _ in stacked] == [t for t, _, _ in from_disk]
    assert [lp for _, lp, _ in stacked] == [lp for _, lp, _ in from_disk]  # the same bits, the same computation
    for prompt, (tokens, lps, _) in zip(prompts, stacked):
        lp, ids = teacher_forced(other, prompt, tokens)
        assert (torch.tensor(lps) - lp[torch.arange(len(ids)), ids]).abs().max().item() <= _tol(lp, 3)


@pytest.mark.parametrize("name", ["mixtral", "olmoe", "qwen2moe"])
def test_tp2_matches_transformers_and_takes_a_modules_weights(moe, name):
    """Mixtral, OLMoE and Qwen2-MoE at TP=2: Mixtral's block_sparse_moe / w1-w3-w2 tensors cut per rank like
    Qwen3-MoE's; OLMoE's whole-projection q/k norms all-reduce each row's sum of squares; Qwen2-MoE's shared
    expert splits as a dense MLP of its own width. Logprobs match transformers' forward and routes its top-k (dense
    layers' rows -1); a module's stacked tensors load too."""
    path, hf = moe[name]  # layer 1 sparse in each: 4 experts of width 32, top-2
    prompts = [_prompt(n, 70 + n) for n in (6, 15)]
    llm = _engine(path, 2, enable_return_routed_experts=True)
    try:
        assert llm.llm_engine.runner.model.model.layers[1].mlp.experts.intermediate_size == 16
        for prompt, (tokens, lps, routes) in zip(prompts, _run(llm, prompts)):
            lp, ids = teacher_forced(hf, prompt, tokens)
            assert (torch.tensor(lps) - lp[torch.arange(len(ids)), ids]).abs().max().item() <= _tol(lp, 2)
            hf_ids, margins = _hf_routes(hf, prompt + tokens[:-1])
            clear = margins > 1e-4  # most positions: the comparison means something (OLMoE's clamp ties ~10%)
            sparse = list(llm.llm_engine.model_config.moe_layers)
            assert clear.mean() >= 0.8 and (routes[:, sparse] == hf_ids)[clear].all()
        other = _hf_model(name, seed=1)
        assert llm.load_weights(other) > 0
        for prompt, (tokens, lps, _) in zip(prompts, _run(llm, prompts)):
            lp, ids = teacher_forced(other, prompt, tokens)
            assert (torch.tensor(lps) - lp[torch.arange(len(ids)), ids]).abs().max().item() <= _tol(lp, 2)
    finally:
        _close(llm)


def test_tp2_dummy_weights_are_tp1_model():
    """Dummy weights are drawn in the full shapes and each rank keeps its part of every expert: the TP=2 engine
    is the TP=1 engine's model (replayed logprobs within the all-reduce's summation order; a replay, since greedy
    picks on near-uniform dummy logits may part at ties)."""
    path = _dummy_config()
    prompts = [_prompt(n, 80 + n) for n in (5, 11)]
    params = [SamplingParams(trace_decode_token_ids=_prompt(6, 90 + i), logprobs=1) for i in range(len(prompts))]

    def replay(llm: LLM) -> list[list[float]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]

    one = _engine(path, 1, load_format="dummy")
    ref = replay(one)
    two = _engine(path, 2, load_format="dummy")
    try:
        got = replay(two)
        full = one.llm_engine.runner.model.model.layers[0].mlp.experts
        part = two.llm_engine.runner.model.model.layers[0].mlp.experts
        assert torch.equal(part.gate_up_proj, full_to_local(part.gate_up_proj, full.gate_up_proj))
        assert torch.equal(part.down_proj, full_to_local(part.down_proj, full.down_proj))
    finally:
        _close(two)
    delta = max(abs(a - b) for x, y in zip(ref, got) for a, b in zip(x, y))
    # as dense TP=2 vs TP=1 (tests/model_runner/test_tensor_parallel.py): fp32 summation order
    assert delta <= LOGPROB_TOL


def test_checkpoint_piece_cuts_every_part_of_a_stacked_tensor():
    """A rank's piece of transformers' stacked gate_up [E * 2I, H]: I/tp rows of each expert's gate and of its
    up part, in expert order (what StackedExperts holds); a single expert's [I, H] tensor: I/tp rows."""
    param = torch.nn.Parameter(torch.empty(3 * 2 * 2, 5))  # rank 1 of 2: E=3, I=4 -> 2 rows per part
    param.tp_dim, param.tp_rank, param.tp_size, param.tp_full_size, param.tp_parts = 0, 1, 2, 24, [4] * 6
    full = torch.arange(24 * 5, dtype=torch.float32).view(24, 5)
    piece = checkpoint_piece(param, full)
    assert torch.equal(piece, torch.cat([full[p * 4 + 2 : p * 4 + 4] for p in range(6)]))
    assert torch.equal(checkpoint_piece(param, full[4:8]), full[6:8])  # expert 0's up_proj alone


def test_tp_needs_a_divisible_expert_width(moe):
    path, _ = moe["norm"]
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's num_attention_heads"):
        EngineConfig(path, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="moe_intermediate_size=32"):
        _check_width(path, 64)


def _check_width(path: str, tp: int) -> None:
    """EngineConfig's divisibility rule for the experts' width alone (the tiny model has 4 heads)."""
    import json
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp()
    shutil.copy(f"{path}/config.json", tmp)
    with open(f"{tmp}/config.json") as f:
        cfg = json.load(f)
    cfg.update(num_attention_heads=64, num_key_value_heads=64, intermediate_size=128, head_dim=1)
    with open(f"{tmp}/config.json", "w") as f:
        json.dump(cfg, f)
    EngineConfig(tmp, device="cpu", tensor_parallel_size=tp, load_format="dummy")


def _dummy_config() -> str:
    import json
    import tempfile

    import transformers
    from test_moe import _COMMON, CONFIGS

    tmp = tempfile.mkdtemp()
    cfg = transformers.Qwen3MoeConfig(**{**_COMMON, "initializer_range": 0.02}, **CONFIGS["norm"],
                                      architectures=["Qwen3MoeForCausalLM"])
    with open(f"{tmp}/config.json", "w") as f:
        json.dump(cfg.to_dict(), f)
    return tmp
