"""The independent reference: tiny random HF models and transformers' teacher-forced log_softmax."""

from __future__ import annotations

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


def hf_rank(lp_row: torch.Tensor, token: int) -> int:
    """1-based rank: 1 + number of vocabulary entries with a strictly larger logprob."""
    return int((lp_row > lp_row[token]).sum()) + 1


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
