"""The independent reference: tiny random HF models and transformers' teacher-forced log_softmax."""

from __future__ import annotations

import inspect

import torch
import transformers

VOCAB = 512

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, rms_norm_eps=1e-6,
               initializer_range=0.5, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


def tiny_configs() -> dict:
    return {
        # Qwen3: tied embeddings, q/k norm, head_dim != hidden/heads.
        "qwen3": transformers.Qwen3Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                          tie_word_embeddings=True),
        # Llama: untied, GQA 4:1, llama3 rope scaling.
        "llama": transformers.LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=1,
                                          tie_word_embeddings=False,
                                          rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                           "factor": 4.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 64}),
        # Qwen2: qkv bias.
        "qwen2": transformers.Qwen2Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2,
                                          tie_word_embeddings=False),
    }


_HF_CLASSES = {"qwen3": transformers.Qwen3ForCausalLM, "llama": transformers.LlamaForCausalLM,
               "qwen2": transformers.Qwen2ForCausalLM}


def save_tiny_models(root) -> dict[str, str]:
    out = {}
    for name, cfg in tiny_configs().items():
        torch.manual_seed(0)
        model = _HF_CLASSES[name](cfg).to(torch.float32).eval()
        path = root / name
        model.save_pretrained(str(path), safe_serialization=True)
        out[name] = str(path)
    return out


def load_hf(path: str, dtype: torch.dtype = torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.no_grad()
def teacher_forced(model, prompt: list[int], output: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output token: (log_softmax of HF logits at the previous position [n, V] float32, and the forced
    token ids [n]). Row i scores output[i] given prompt + output[:i]."""
    ids = torch.tensor([prompt + output], device=model.device)
    logits = model(ids).logits[0].float()  # [P + n, V]
    lp = logits[len(prompt) - 1 : len(prompt) - 1 + len(output)].log_softmax(-1).cpu()
    return lp, torch.tensor(output)


def teacher_forced_stepwise(model, prompt: list[int], output: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """teacher_forced's result from transformers fed one token per call (its cache carried): a hybrid model's
    linear-attention layers then run transformers' recurrent form of the delta rule, the form the engine runs,
    instead of the one-pass chunked form (the same maths, other roundings: on the tiny test models the two
    transformers forms disagree by up to 2.6e-3 in a logprob, the engine and the stepwise form by < 5e-5)."""
    ids, cache, rows = prompt + output, None, []
    for i, t in enumerate(ids[:-1]):  # the model makes its own cache on the first call (its class differs between
        # releases); each token's position given (transformers 5.25's Bamba numbers positions from 0 at every call
        # without them)
        out = model(torch.tensor([[t]], device=model.device), past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[i]], device=model.device))
        cache = out.past_key_values
        rows.append(out.logits[0].float())
    logits = torch.cat(rows)  # [P + n - 1, V]: row i scores ids[i + 1]
    lp = logits[len(prompt) - 1 :].log_softmax(-1).cpu()
    return lp, torch.tensor(output)


def spread_norms(model, low: float = 0.5, high: float = 1.5) -> None:
    """Every norm weight of `model` drawn from [low, high) instead of transformers' start (1, or 0 for a (1 + w)
    norm), so a misapplied norm shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(low, high)


def save_both_namings(hf, hub, module) -> dict[str, torch.Tensor]:
    """A multimodal model twice: `hub` by save_pretrained (the hub's names), `module` with the same config files and
    the module's own state_dict names (`model.language_model.*`, what a trainer's module hands over). Returns that
    state_dict."""
    from safetensors.torch import save_file

    hf.save_pretrained(str(hub))
    for path in hub.iterdir():
        if path.name != "model.safetensors":
            (module / path.name).write_bytes(path.read_bytes())
    state = {n: t.clone().contiguous() for n, t in hf.state_dict().items()}
    save_file(state, str(module / "model.safetensors"))
    return state


def trace_logprobs(llm, prompts: list[list[int]], traces: list[list[int]]) -> list[list[float]]:
    """The engine's logprob of every trace token, each prompt replaying its trace (enable_trace_replay)."""
    from replayllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(trace_decode_token_ids=t, logprobs=0) for t in traces], use_tqdm=False)
    return [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]


def max_gap_to_transformers(hf, prompts: list[list[int]], traces: list[list[int]],
                            logprobs: list[list[float]]) -> float:
    """max |engine - transformers| over every trace token (transformers' teacher-forced log_softmax)."""
    gap = 0.0
    for prompt, trace, engine in zip(prompts, traces, logprobs):
        lp, tokens = teacher_forced(hf, prompt, trace)
        gap = max(gap, (torch.tensor(engine) - lp[torch.arange(len(tokens)), tokens]).abs().max().item())
    return gap


def hf_rank(lp_row: torch.Tensor, token: int) -> int:
    """vLLM's 1-based rank: the vocabulary entries with a logprob >= the token's (itself included)."""
    return int((lp_row >= lp_row[token]).sum())


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF greedy continuation, with the top-1/top-2 margin at each step (for near-tie tolerance)."""
    ids = list(prompt)
    margins = []
    for _ in range(n):
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
        top2 = logits.topk(2).values
        margins.append(float(top2[0] - top2[1]))
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], margins


def minimax_m2_reference_problem() -> str | None:
    """Why the installed transformers' MiniMax-M2 cannot be the reference, or None: its config must turn the hub's
    `rotary_dim` into the rotating share of each head (MiniMax's and vLLM's model rotate rotary_dim of head_dim;
    transformers 5.17, the GPU machine's, drops the key and rotates whole heads; 5.25 converts it)."""
    if not hasattr(transformers, "MiniMaxM2Config"):
        return "this transformers has no MiniMax-M2"
    cfg = transformers.MiniMaxM2Config(hidden_size=64, num_attention_heads=4, head_dim=16, rotary_dim=8)
    if (cfg.rope_parameters or {}).get("partial_rotary_factor") != 0.5:
        return (f"transformers {transformers.__version__}'s MiniMaxM2Config ignores rotary_dim (whole heads rotate: "
                "not MiniMax-M2's model); its logprobs are no reference")
    return None


def gemma3n_reference_problem() -> str | None:
    """Why the installed transformers' Gemma 3n cannot be the reference on the test prompts, or None: 5.25 reads ids
    past `vocab_size_per_layer_input` as the per-layer table's row 0 (the engine too); 5.17, the GPU machine's, looks
    them up and fails (IndexError, session 45, H100: the CUDA engine met the CPU engine there)."""
    try:
        from transformers.models.gemma3n import modeling_gemma3n
    except ImportError:
        return "this transformers has no Gemma 3n"
    if "vocab_size_per_layer_input" not in inspect.getsource(modeling_gemma3n.Gemma3nTextModel.get_per_layer_inputs):
        return (f"transformers {transformers.__version__}'s Gemma 3n indexes its per-layer table with ids past it "
                "(IndexError on the test prompts); 5.25 reads them as row 0")
    return None


def mamba2_reference_problem() -> str | None:
    """Why the installed transformers' Mamba-2 hybrids (Granite 4.0-H, NemotronH, and Bamba / Falcon-H1, whose mixer
    is the same code) cannot be the reference, or None:
    the engine meets 5.25's on the CPU (within 5e-5), and on the GPU machine's 5.17 (session 42, H100) the CUDA engine
    met the CPU engine while 5.17's GraniteMoeHybrid Mamba layers gave logprobs up to 3.0 from it and 5.17's NemotronH
    disagreed with itself (one pass against one token per call: 1e-2); 5.17's attention-free Mamba2ForCausalLM gave
    logprobs up to 6.3 from the CUDA engine (session 44, H100), which met the CPU engine there."""
    major, minor = (int(v) for v in transformers.__version__.split(".")[:2])
    if (major, minor) < (5, 25):
        return (f"transformers {transformers.__version__}'s Mamba-2 hybrids are not the reference (< 5.25: see "
                "hf_reference.mamba2_reference_problem); the CUDA engine against the CPU engine checks them here")
    return None


def gpt_oss_reference_problem() -> str | None:
    """Why the installed transformers' GPT-OSS cannot be the reference, or None. Its experts module (built as a model
    builds it, experts_implementation="eager") against a transcription of its own per-expert loop (gate at the even
    columns of x @ gate_up_proj + bias, up at the odd ones, the clamped SwiGLU, then down_proj + bias, weighted):
    transformers 5.17 (the GPU machine's) disagrees with that definition (sessions 33-35): its module clamps at a fixed
    7.0 (the released models' swiglu_limit) whatever the config says, and its config has no swiglu_alpha; 5.25
    agrees."""
    cfg = transformers.GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=3, num_experts_per_tok=2,
                                    swiglu_limit=2.5, experts_implementation="eager")
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(cfg).eval()
    alpha = getattr(cfg, "swiglu_alpha", 1.702)  # 5.17's config has none (its module: 1.702)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=g))
        x = torch.randn(5, 16, generator=g)
        ids = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [2, 1]])
        weights = torch.rand(5, 2, generator=g)
        ref = torch.zeros_like(x)
        for t in range(5):
            for j, e in enumerate(ids[t].tolist()):
                gate_up = x[t] @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
                gate, up = gate_up[0::2].clamp(max=2.5), gate_up[1::2].clamp(min=-2.5, max=2.5)
                y = ((up + 1) * gate * torch.sigmoid(gate * alpha)) @ experts.down_proj[e]
                ref[t] += (y + experts.down_proj_bias[e]) * weights[t, j]
        try:
            got = experts(x, ids, weights)
        except Exception as e:  # another calling convention is no reference either
            return f"transformers {transformers.__version__}'s GptOssExperts fails on the model's inputs: {e!r}"
    err = (got - ref).abs().max().item()
    if err > 1e-3 * ref.abs().max().item():
        return (f"transformers {transformers.__version__}'s GptOssExperts disagrees with its own per-expert definition "
                f"at the config's swiglu_limit (max |diff| {err:.3g}; 5.17 clamps at a fixed 7.0): not a reference for "
                "these GPT-OSS configs (5.25's agrees)")
    return None
