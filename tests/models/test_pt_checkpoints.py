"""PyTorch .bin checkpoints (model_runner_v2/loader.weight_files, vLLM's load_format "auto" / "pt"): pytorch_model.bin
and the shards of pytorch_model.bin.index.json load the same weights as the safetensors files; "auto" prefers the
safetensors files where a folder has both; "safetensors" / "pt" refuse a folder without their files, naming them;
update_weights_from_disk reads .bin folders too."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from replayllm import LLM, SamplingParams

ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=64)
PROMPT, TRACE = [3, 17, 5, 40, 9], [11, 2, 30, 7]


def _model(seed: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).float().eval()


def _pt_folder(model, safetensors_folder, folder, shards: int = 1) -> str:
    """`folder` with the safetensors folder's config files and the model's tensors in `shards` PyTorch files."""
    shutil.copytree(safetensors_folder, folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if shards == 1:
        torch.save(state, f"{folder}/pytorch_model.bin")
        return str(folder)
    names, weight_map = sorted(state), {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n] for n in names[i::shards]}
        torch.save(part, f"{folder}/{file}")
        weight_map.update(dict.fromkeys(part, file))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(folder)


def _logprobs(llm: LLM) -> list[float]:
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(trace_decode_token_ids=TRACE, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    return [d[t].logprob for t, d in zip(out.token_ids, out.logprobs)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pt")
    model, other = _model(0), _model(1)
    model.save_pretrained(root / "st")
    return {"st": str(root / "st"), "bin": _pt_folder(model, root / "st", root / "bin"),
            "sharded": _pt_folder(model, root / "st", root / "sharded", shards=3),
            "other_bin": _pt_folder(other, root / "st", root / "other_bin")}


def test_bin_files_load_the_same_weights_as_safetensors(folders):
    expected = _logprobs(LLM(folders["st"], **ENGINE))
    assert _logprobs(LLM(folders["bin"], **ENGINE)) == expected
    assert _logprobs(LLM(folders["sharded"], **ENGINE)) == expected
    assert _logprobs(LLM(folders["bin"], load_format="pt", **ENGINE)) == expected
    assert _logprobs(LLM(folders["other_bin"], **ENGINE)) != expected  # the files' weights, not the config's


def test_the_folders_that_hold_weights(folders, tmp_path):
    """loader.has_weight_files (rl-demo's random weights for a config-only folder): every format, not a bare one."""
    from replayllm.model_runner_v2.loader import has_weight_files

    assert all(has_weight_files(folders[name]) for name in ("st", "bin", "sharded"))
    assert not has_weight_files(str(tmp_path))


def test_auto_prefers_safetensors_and_each_format_names_its_files(folders, tmp_path):
    both = tmp_path / "both"
    shutil.copytree(folders["st"], both)
    shutil.copy(f"{folders['other_bin']}/pytorch_model.bin", both)  # other weights beside the safetensors ones
    assert _logprobs(LLM(str(both), **ENGINE)) == _logprobs(LLM(folders["st"], **ENGINE))
    assert _logprobs(LLM(str(both), load_format="pt", **ENGINE)) == _logprobs(LLM(folders["other_bin"], **ENGINE))
    with pytest.raises(FileNotFoundError, match="model.safetensors or model.safetensors.index.json"):
        LLM(folders["bin"], load_format="safetensors", **ENGINE)
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin or pytorch_model.bin.index.json"):
        LLM(folders["st"], load_format="pt", **ENGINE)


def test_update_weights_from_disk_reads_a_bin_folder(folders):
    llm = LLM(folders["st"], **ENGINE)
    assert llm.llm_engine.update_weights_from_disk(folders["other_bin"]) > 0
    assert _logprobs(llm) == _logprobs(LLM(folders["other_bin"], **ENGINE))


def test_a_legacy_format_bin_file_loads(folders, tmp_path):
    """torch's pre-1.6 (non-zip) format, which cannot be memory-mapped: read without the map."""
    legacy = tmp_path / "legacy"
    shutil.copytree(folders["bin"], legacy)
    state = torch.load(f"{folders['bin']}/pytorch_model.bin", weights_only=True)
    torch.save(state, legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert _logprobs(LLM(str(legacy), **ENGINE)) == _logprobs(LLM(folders["st"], **ENGINE))


def test_a_hub_repo_without_safetensors_has_its_bin_files_fetched(folders, tmp_path, monkeypatch):
    """model_source.resolve_model_path: the safetensors patterns first; a snapshot without any safetensors file is
    fetched again with the PyTorch files' patterns (huggingface_hub's snapshot_download stood in for)."""
    import huggingface_hub

    from replayllm.model_source import resolve_model_path

    calls = []

    def snapshot(repo_id, local_files_only, allow_patterns):
        calls.append(allow_patterns)
        if repo_id == "org/tokenizer-only" and "pytorch_model*.bin" in allow_patterns:
            raise OSError("not in the cache")  # offline: the second fetch fails, the first folder stands
        return folders["st"] if repo_id == "org/safetensors" else folders["bin"]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    assert resolve_model_path("org/safetensors") == folders["st"] and len(calls) == 1
    assert "pytorch_model*.bin" not in calls[0]
    assert resolve_model_path("org/bin-only") == folders["bin"] and len(calls) == 3
    assert "pytorch_model*.bin" in calls[2]
    assert resolve_model_path("org/tokenizer-only") == folders["bin"] and len(calls) == 5
