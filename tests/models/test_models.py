"""Our Qwen3/Llama/Qwen2/Mistral/Phi-3 models vs transformers' forward, over a real paged KV cache; loader and
configs."""

from __future__ import annotations

import inspect
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
import transformers
from helpers.tolerances import LOGPROB_TOL, rounding_tol
from transformers import (
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
)

from replayllm import embedded_model
from replayllm.config import ModelConfig
from replayllm.model_runner_v2 import loader
from replayllm.model_runner_v2.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from replayllm.model_runner_v2.loader import load_model
from replayllm.model_runner_v2.models.registry import SUPPORTED_ARCHITECTURES, get_model_class
from replayllm.rope_settings import RopeSettings

CPU = torch.device("cpu")
PROMPT_LEN = 20
SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, rms_norm_eps=1e-6,
             initializer_range=0.5, max_position_embeddings=128, dtype="float32")


def _qwen3_config() -> Qwen3Config:  # tied, head_dim 32 != hidden / heads
    return Qwen3Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       tie_word_embeddings=True)


def _llama_config() -> LlamaConfig:  # untied, GQA 4:1, biases, llama3 rope scaling that touches all bands
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    small = {**SMALL, "max_position_embeddings": 256}
    return LlamaConfig(**small, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                       attention_bias=True, mlp_bias=True, rope_parameters=rope)


def _qwen2_config() -> Qwen2Config:  # qkv bias
    return Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def _mistral_config(sliding_window: int | None = 64) -> MistralConfig:  # a window longer than any prompt here
    return MistralConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         sliding_window=sliding_window)


def _phi3_config() -> Phi3Config:  # checkpoints with fused qkv_proj / gate_up_proj; GQA 2:1
    return Phi3Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)


def _olmo2_config() -> Olmo2Config:  # norms after the sub-blocks, q/k norms over whole projections; GQA 2:1
    return Olmo2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)


def _granite_config() -> GraniteConfig:  # Llama's layers and four scalars (none a power of two, none the default)
    return GraniteConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=1.7,
                         residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=2.5, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)


def _smollm3_config() -> SmolLM3Config:  # layer 1 without rope (NoPE), as every 4th layer of SmolLM3-3B
    return SmolLM3Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, no_rope_layers=[1, 0],
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


HF_CLASSES = {"qwen3": (_qwen3_config, transformers.Qwen3ForCausalLM),
              "llama": (_llama_config, transformers.LlamaForCausalLM),
              "qwen2": (_qwen2_config, transformers.Qwen2ForCausalLM),
              "mistral": (_mistral_config, transformers.MistralForCausalLM),
              "phi3": (_phi3_config, transformers.Phi3ForCausalLM),
              "olmo2": (_olmo2_config, transformers.Olmo2ForCausalLM),
              "granite": (_granite_config, transformers.GraniteForCausalLM),
              "smollm3": (_smollm3_config, transformers.SmolLM3ForCausalLM)}


def _save_hf(tmp_path, arch: str, **save_kwargs):
    make_config, hf_cls = HF_CLASSES[arch]
    torch.manual_seed(0)
    hf = hf_cls(make_config()).to(torch.float32).eval()
    path = str(tmp_path / arch)
    hf.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return hf, path


def _run(model, mc: ModelConfig, token_ids: list[int], chunks: list[int], block_size: int = 4):
    """Feed one request's tokens in steps of `chunks` sizes through a paged KV cache; logits [sum, V]."""
    num_blocks = 16
    caches = [torch.zeros(2, num_blocks, block_size, mc.num_kv_heads, mc.head_dim, dtype=mc.dtype)
              for _ in range(mc.num_layers)]
    # A scrambled block table, so any position -> slot mix-up shows up as wrong logits.
    table = torch.tensor([[11, 3, 7, 0, 14, 5, 9, 1, 12, 2, 6, 15, 4, 8, 10, 13]], dtype=torch.int32)
    ids = torch.tensor(token_ids, dtype=torch.int64)
    out, start = [], 0
    for n in chunks:
        pos = torch.arange(start, start + n)
        md = AttentionMetadata(
            query_start_loc=torch.tensor([0, n]),
            seq_lens=torch.tensor([start + n]),
            slot_mapping=table[0, pos // block_size].long() * block_size + pos % block_size,
            block_tables=table,
            token_req_idx=torch.zeros(n, dtype=torch.int64),
            positions=pos,
            max_query_len=n,
            max_seq_len=start + n,
        )
        with torch.no_grad(), set_forward_context(ForwardContext(md, caches)):
            out.append(model.compute_logits(model(ids[start:start + n], pos)))
        start += n
    return torch.cat(out)


def _hf_stepped(hf, token_ids: list[int], prefill: int) -> torch.Tensor:
    """transformers' own incremental path (its KV cache): prefill, then one token per call; logits [T, V]."""
    cache = transformers.DynamicCache(config=hf.config)
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    spans = [(0, prefill)] + [(i, i + 1) for i in range(prefill, len(token_ids))]
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([token_ids[a:b]]), use_cache=True, **{cache_kw: cache}).logits[0]
                          for a, b in spans])


def _prompt(vocab: int, n: int = PROMPT_LEN) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "mistral", "phi3", "olmo2", "granite", "smollm3"])
def test_logits_match_transformers_prefill_and_decode(tmp_path, arch):
    hf, path = _save_hf(tmp_path, arch)
    mc = ModelConfig.from_pretrained(path)
    assert mc.dtype == torch.float32 and mc.architecture == type(hf).__name__
    model = load_model(mc, CPU)
    ids = _prompt(mc.vocab_size)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # [T, V]
    full = _run(model, mc, ids, [PROMPT_LEN])
    # Our layers vs transformers': another implementation, fp32 rounding (logits ~15: tolerances.LOGPROB_TOL).
    assert (full - ref).abs().max().item() <= LOGPROB_TOL
    # Prefill 12, then one decode step per token: the later steps only see K/V through the cache. Compared
    # with transformers' own cached decode (same matmul shapes), and with the full forward: one-row vs many-row
    # matmuls round differently in fp32 (up to ~1.1e-4 on the Llama), within the same bound.
    stepped = _run(model, mc, ids, [12] + [1] * (PROMPT_LEN - 12), block_size=16 if arch == "qwen2" else 4)
    assert (stepped - _hf_stepped(hf, ids, 12)).abs().max().item() <= LOGPROB_TOL
    assert (stepped - ref).abs().max().item() <= LOGPROB_TOL
    if arch == "qwen3":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_sharded_checkpoint_loads_identically(tmp_path):
    _, single = _save_hf(tmp_path / "single", "llama")
    _, sharded = _save_hf(tmp_path / "sharded", "llama", max_shard_size="40KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert not os.path.isfile(os.path.join(sharded, "model.safetensors"))
    ids = _prompt(300)
    logits = [_run(load_model(ModelConfig.from_pretrained(p), CPU), ModelConfig.from_pretrained(p), ids, [20])
              for p in (single, sharded)]
    assert torch.equal(logits[0], logits[1])


def test_load_checkpoint_rejects_unknown_and_missing_names(tmp_path):
    _, path = _save_hf(tmp_path, "qwen3")
    mc = ModelConfig.from_pretrained(path)
    files = loader.safetensors_files(path)
    weights = dict(loader.iterate_weights(files, torch.float32))
    model = load_model(mc, CPU, load_format="dummy")
    with pytest.raises(ValueError, match="model.layers.0.mlp.foo.weight"):
        model.load_checkpoint([*weights.items(), ("model.layers.0.mlp.foo.weight", torch.zeros(1))])
    del weights["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="missing 1 tensors.*layers.1.self_attn.qkv_proj.weight"):
        model.load_checkpoint(weights.items())
    bad = {**weights, "model.norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match="model.norm.weight"):
        model.load_checkpoint(bad.items())


def test_untied_checkpoint_without_lm_head_ties_it(tmp_path):
    _, path = _save_hf(tmp_path, "qwen2")
    weights = dict(loader.iterate_weights(loader.safetensors_files(path), torch.float32))
    del weights["lm_head.weight"]
    model = load_model(ModelConfig.from_pretrained(path), CPU, load_format="dummy")
    model.load_checkpoint(weights.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dummy_load_reads_no_weight_files(tmp_path, monkeypatch):
    # Qwen3-0.6B layer shapes (2 layers to keep it quick); only config.json on disk.
    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=4096, tie_word_embeddings=True, dtype="bfloat16")
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json"]
    monkeypatch.setattr(loader, "iterate_weights", lambda *a: pytest.fail("dummy load read weights"))
    mc = ModelConfig.from_pretrained(str(tmp_path))
    assert mc.dtype == torch.bfloat16
    model = load_model(mc, CPU, load_format="dummy", seed=3)
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    logits = _run(model, mc, [1, 2, 3, 4, 5], [5])
    assert logits.shape == (5, 151936) and torch.isfinite(logits).all()
    again = load_model(mc, CPU, load_format="dummy", seed=3)
    assert torch.equal(again.model.layers[1].mlp.down_proj.weight, model.model.layers[1].mlp.down_proj.weight)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(mc, CPU)
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        load_model(mc, CPU, load_format="pt")
    with pytest.raises(ValueError, match="dummy"):
        load_model(mc, CPU, load_format="npcache")  # vLLM's, not built


def test_unknown_architecture_lists_supported(tmp_path):
    config = _qwen2_config()
    config.architectures = ["RwkvForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        ModelConfig.from_pretrained(str(tmp_path))
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)
    # the list itself: test_registry_covers_the_ground_floor_architecture_list (each name a registry class of it)
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        get_model_class(["RwkvForCausalLM"])


def test_registry_covers_the_ground_floor_architecture_list():
    """config.SUPPORTED_ARCHITECTURES (read without importing the models) and the registry name the same set."""
    from replayllm.model_runner_v2.models import registry

    assert set(registry._MODELS) == set(SUPPORTED_ARCHITECTURES)
    assert all(get_model_class([name]).__name__ == name for name in SUPPORTED_ARCHITECTURES)


def test_bad_dtype_and_missing_model(tmp_path, monkeypatch):
    _, path = _save_hf(tmp_path, "qwen2")
    assert ModelConfig.from_pretrained(path, dtype="half").dtype == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_pretrained(path, dtype="fp8")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        ModelConfig.from_pretrained("no-such-org/no-such-model-xyz")


def test_rope_theta_new_and_legacy_config_forms():
    new = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 12345.0})
    assert RopeSettings.from_hf_config(new) == RopeSettings(theta=12345.0)
    legacy = SimpleNamespace(rope_theta=54321.0, rope_scaling=None)
    assert RopeSettings.from_hf_config(legacy) == RopeSettings(theta=54321.0)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    old = RopeSettings.from_hf_config(SimpleNamespace(rope_theta=500000.0, rope_scaling=scaling))
    cfg = LlamaConfig(hidden_size=2048, num_attention_heads=16, max_position_embeddings=131072,
                      rope_parameters={**scaling, "rope_theta": 500000.0})
    assert RopeSettings.from_hf_config(cfg) == old and old.rope_type == "llama3" and old.theta == 500000.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    # theta ** e magnifies the rounding of e by ln(theta) (relative); the llama3 band's few roundings fit in the 8.
    assert torch.allclose(old.inv_freq(128), hf_inv_freq, rtol=rounding_tol(math.log(500000.0)), atol=0)
    with pytest.raises(ValueError, match="dynamic rope scaling is missing 'factor'"):
        RopeSettings.from_hf_config(SimpleNamespace(rope_theta=1e4, rope_scaling={"rope_type": "dynamic"}))
    with pytest.raises(ValueError, match="'mrope_interleaved' is not supported"):  # a type not built: refused
        RopeSettings.from_hf_config(SimpleNamespace(rope_theta=1e4, rope_scaling={"rope_type": "mrope_interleaved"}))


def test_embedded_model_materialises_and_generates(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLAYLLM_CACHE_DIR", str(tmp_path))
    assert embedded_model.is_embedded(embedded_model.DEFAULT_MODEL) and not embedded_model.is_embedded("x/y")
    path = embedded_model.materialize(embedded_model.DEFAULT_MODEL)
    assert path == os.path.join(str(tmp_path), "models", "tiny-qwen3-v3")
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(path, name)), name
    assert embedded_model.materialize(embedded_model.DEFAULT_MODEL) == path  # second call reuses it
    assert [p for p in os.listdir(os.path.dirname(path)) if p.startswith(".")] == []  # no temp dir left

    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.encode("Once upon a time") == [12522, 5193, 264, 882]
    assert tok.eos_token_id == 151645 and tok.pad_token_id == 151643
    messages = [{"role": "user", "content": "hi"}]
    chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
        assert "chat_template" in json.load(f)

    mc = ModelConfig.from_pretrained(embedded_model.DEFAULT_MODEL)
    assert mc.path == path and mc.eos_token_ids == (151645, 151643) and mc.architecture == "Qwen3ForCausalLM"
    model = load_model(mc, CPU)
    ids = tok.encode("Once upon a time")
    for _ in range(8):  # greedy, recomputing the whole sequence each step (simple, the model is tiny)
        ids.append(int(_run(model, mc, ids, [len(ids)])[-1].argmax()))
    generated = ids[4:]
    assert len(set(generated)) > 1, generated


def test_dummy_values_depend_on_place_and_seed_not_on_chunking(monkeypatch):
    """loader._hash_uniform: U[-1, 1) in 2^-23 steps, a function of (index, seed) only — chunked alike or not
    (the GPU hashes bigger chunks than the CPU: tests/model_runner/test_gpu.py compares the two devices bit for bit)."""
    a = loader._hash_uniform(11, 100_000, 5, CPU)
    assert a.dtype == torch.float32 and -1.0 <= float(a.min()) and float(a.max()) < 1.0
    assert abs(float(a.mean())) < 0.01 and abs(float(a.std()) - 3**-0.5) < 0.01  # U[-1, 1): std 1/sqrt(3)
    assert torch.equal(loader._hash_uniform(12, 5, 5, CPU), a[1:6])  # the index, not the call, decides
    assert not torch.equal(loader._hash_uniform(11, 100_000, 6, CPU), a)
    monkeypatch.setitem(loader._HASH_CHUNK, "cpu", 777)
    assert torch.equal(loader._hash_uniform(11, 100_000, 5, CPU), a)


def test_qwen_sliding_windows_cap_max_model_len_only_where_a_layer_slides(tmp_path):
    """Qwen2 / Qwen3 / Qwen3-MoE: use_sliding_window with a layer at or past max_window_layers (Qwen3-MoE: every
    layer) has a window, which disable_sliding_window caps max_model_len at as Mistral's; use_sliding_window
    false, or max_window_layers at the layer count, leaves full attention everywhere and the position limit."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    from replayllm.config import EngineConfig

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    cases = [("q2-slides", transformers.Qwen2ForCausalLM, _qwen2_window_config(24), 24),
             ("q2-off", transformers.Qwen2ForCausalLM,
              Qwen2Config(**SMALL, num_attention_heads=4, sliding_window=24), None),
             ("q3-none-slides", transformers.Qwen3ForCausalLM,
              Qwen3Config(**SMALL, num_attention_heads=4, use_sliding_window=True, sliding_window=24,
                          max_window_layers=2), None),
             ("q3-slides", transformers.Qwen3ForCausalLM,
              Qwen3Config(**SMALL, num_attention_heads=4, use_sliding_window=True, sliding_window=24,
                          max_window_layers=0), 24),
             ("moe", transformers.Qwen3MoeForCausalLM,
              Qwen3MoeConfig(**SMALL, num_attention_heads=4, use_sliding_window=True, sliding_window=24, **moe), 24)]
    for name, cls, cfg, window in cases:
        torch.manual_seed(0)
        cls(cfg).save_pretrained(str(tmp_path / name))
        assert ModelConfig.from_pretrained(str(tmp_path / name)).sliding_window == window, name
        assert EngineConfig(model=str(tmp_path / name), device="cpu").max_model_len == 128, name
        assert EngineConfig(model=str(tmp_path / name), device="cpu",
                            disable_sliding_window=True).max_model_len == (window or 128), name


def _qwen2_window_config(window: int = 16) -> Qwen2Config:  # the second of two layers slides (max_window_layers 1)
    return Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                       use_sliding_window=True, sliding_window=window, max_window_layers=1)


@pytest.mark.parametrize("arch", ["mistral", "qwen2-sliding"])
def test_a_windowed_engine_generates_what_transformers_scores(tmp_path, arch):
    """Through LLM: a window as long as the sequence (16 = 10 prompt + 6 generated tokens, disable_sliding_window's
    max_model_len), greedy tokens and their logprobs against transformers' teacher-forced log_softmax (which
    applies the window: Mistral's on every layer, Qwen2's on the layers from max_window_layers on)."""
    from replayllm import LLM, SamplingParams

    torch.manual_seed(0)
    hf = (transformers.MistralForCausalLM(_mistral_config(16)) if arch == "mistral"
          else transformers.Qwen2ForCausalLM(_qwen2_window_config(16))).to(torch.float32).eval()
    hf.save_pretrained(str(tmp_path / "m"))
    llm = LLM(str(tmp_path / "m"), device="cpu", dtype="float32", skip_tokenizer_init=True, disable_sliding_window=True)
    assert llm.llm_engine.config.max_model_len == 16
    prompt = _prompt(300, 10)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, temperature=0.0, logprobs=0,
                                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + list(out.token_ids)])).logits[0].float(), -1)
    for i, tok in enumerate(out.token_ids):
        row = ref[len(prompt) - 1 + i]
        assert row.max().item() - row[tok].item() <= LOGPROB_TOL  # greedy (a near tie may round either way)
        assert abs(out.logprobs[i][tok].logprob - row[tok].item()) <= LOGPROB_TOL
