"""Model names: local directories, hub ids from the local HF cache (HF_HUB_OFFLINE), clear errors."""

from __future__ import annotations

import shutil

import pytest

from replayllm import LLM, SamplingParams
from replayllm.model_source import resolve_model_path


def _fake_hub_cache(root, repo_id: str, src: str) -> None:
    """Lay out a checkpoint the way huggingface_hub caches it: models--org--name/{refs/main, snapshots/<rev>}."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    shutil.copytree(src, repo / "snapshots" / rev)


def test_hub_id_resolves_from_local_cache_offline(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    _fake_hub_cache(tmp_path, "someorg/tiny-llama", tiny_models["llama"])
    path = resolve_model_path("someorg/tiny-llama")
    assert path.startswith(str(tmp_path)) and path.endswith("0123456789abcdef0123456789abcdef01234567")
    llm = LLM("someorg/tiny-llama", device="cpu", skip_tokenizer_init=True, max_model_len=64)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE") as e:
        resolve_model_path("someorg/not-cached")
    assert "\n" not in str(e.value)
    from replayllm.model_source import _not_found  # online, the hub client's cause is a paragraph: its first line
    assert str(_not_found("a/b", OSError("Repo not found.\nCheck your connection."))).endswith("Repo not found.")


def test_local_dir_and_unknown_architecture(tiny_models, tmp_path):
    assert resolve_model_path(tiny_models["qwen2"]) == tiny_models["qwen2"]
    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["qwen2"], bad)
    cfg = (bad / "config.json").read_text().replace("Qwen2ForCausalLM", "RwkvForCausalLM")
    (bad / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(str(bad), device="cpu", skip_tokenizer_init=True)
