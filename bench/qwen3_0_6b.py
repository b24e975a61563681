"""A Qwen3-0.6B-shaped config.json (no weights: used with load_format="dummy")."""

from __future__ import annotations

import json
import os
import tempfile

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645,
}


def write_config(root: str | None = None) -> str:
    path = root or tempfile.mkdtemp(prefix="qwen3-0.6b-dummy-")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(QWEN3_0_6B, f)
    return path
