"""LLM / LLMEngine behaviour on the embedded model: options, stops, n, seeds, prompt logprobs, chat, abort."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.hf_reference import hf_rank, load_hf
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", max_model_len=256, seed=0)


def test_public_names_and_lazy_import():
    import replayllm

    for name in ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "TokensPrompt"):
        assert getattr(replayllm, name) is not None
    with pytest.raises(AttributeError):
        _ = replayllm.NotAName


def test_repo_root_import_does_not_shadow_pypi_kernels():
    """From the repo root the folders are importable as top-level modules (docs/architecture.md, "The import
    hazard"); transformers must neither be fooled nor broken: with Hugging Face's `kernels` installed (a
    dependency of transformers >= 5.25), `import kernels` is that package and transformers' models import; without
    it, transformers does not take this folder for it. (An installed `kernels` that the transformers release does not
    accept, e.g. under 5.17 from bench/transformers_release.sh, is still the package `import kernels` finds.)"""
    code = ("import os, kernels; from importlib.metadata import distributions; "
            "from transformers import Qwen3ForCausalLM; from transformers.utils import is_kernels_available; "
            "installed = any(d.metadata['Name'] == 'kernels' for d in distributions()); "
            "print(installed, is_kernels_available(), os.path.dirname(os.path.abspath(kernels.__file__)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    installed, available, where = out.split()
    ours = os.path.join(os.path.abspath(ROOT), "kernels")
    if installed == "True":
        assert where != ours  # the installed package, not this folder
    else:  # no PyPI `kernels`: the folder imports, and transformers did not take it for one
        assert (where, available) == (ours, "False")


def test_engine_is_a_front_end_around_a_core(llm):
    """LLMEngine composes the input processor, the output processor and an EngineCore (no inheritance); both
    output processors, the in-process one and the engine core process's, are sinks of the core's steps."""
    from replayllm.engine.core_outputs import CoreOutputCollector
    from replayllm.engine.engine_core import EngineCore, OutputSink
    from replayllm.engine.input_processor import InputProcessor
    from replayllm.engine.output_processor import OutputProcessor

    engine = llm.llm_engine
    assert isinstance(engine.core, EngineCore) and not isinstance(engine, (InputProcessor, EngineCore))
    assert engine.runner is engine.core.runner and engine.scheduler is engine.core.scheduler
    assert isinstance(engine.output_processor, OutputProcessor) and isinstance(engine.output_processor, OutputSink)
    assert isinstance(CoreOutputCollector(), OutputSink)


def test_unknown_option_is_type_error_and_bad_values_are_value_errors():
    with pytest.raises(TypeError):
        LLM(device="cpu", not_an_option=1)
    for bad in (dict(dtype="int7"), dict(block_size=0), dict(block_size=12), dict(max_model_len=10**7),
                dict(attention_backend="flash"), dict(quantization="awq"), dict(tensor_parallel_size=0),
                dict(load_format="npcache"), dict(gpu_memory_utilization=1.5), dict(max_num_seqs=0),
                dict(enable_prefix_caching="yes"), dict(num_gpu_blocks_override=1)):
        with pytest.raises(ValueError):
            LLM(**{"device": "cpu", "max_model_len": 256, **bad})


def test_generate_shapes_and_greedy_determinism(llm):
    params = SamplingParams(temperature=0, max_tokens=6)
    a = llm.generate(["Once upon a time", "Hello"], params, use_tqdm=False)
    b = llm.generate(["Once upon a time"], params, use_tqdm=False)
    assert len(a) == 2 and a[0].prompt == "Once upon a time"
    assert a[0].prompt_token_ids == [12522, 5193, 264, 882]
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids  # batch composition does not matter
    assert len(set(a[0].outputs[0].token_ids)) > 1  # the embedded model is not degenerate
    assert a[0].finished and a[0].outputs[0].finish_reason == "length"
    assert a[0].outputs[0].text == llm.get_tokenizer().decode(a[0].outputs[0].token_ids, skip_special_tokens=True)


def test_token_id_prompts_and_validation(llm):
    out = llm.generate({"prompt_token_ids": [12522, 5193, 264, 882]}, SamplingParams(temperature=0, max_tokens=3),
                       use_tqdm=False)
    ref = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids and out[0].prompt is None
    for bad in ({"prompt_token_ids": []}, {"prompt_token_ids": [-1]}, {"prompt_token_ids": [10**9]}, 42):
        with pytest.raises(ValueError):
            llm.generate([bad], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 300}, use_tqdm=False)
    with pytest.raises(ValueError):  # one params object per prompt, counts must agree
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_seeded_sampling_reproducible_and_n(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=1234)
    a = llm.generate(["Once upon a time"], p, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(["Hello", "Once upon a time"], p, use_tqdm=False)[1].outputs[0].token_ids
    assert a == b  # same seed -> same tokens, whatever the batch
    c = llm.generate(["Once upon a time"], SamplingParams(temperature=1.0, max_tokens=8, seed=99),
                     use_tqdm=False)[0].outputs[0].token_ids
    assert c != a
    other = LLM(device="cpu", dtype="float32", max_model_len=256, seed=0)
    assert other.generate(["Once upon a time"], p, use_tqdm=False)[0].outputs[0].token_ids == a
    outs = llm.generate(["Once upon a time"], SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=5),
                        use_tqdm=False)
    comps = outs[0].outputs
    assert [c.index for c in comps] == [0, 1, 2] and all(len(c.token_ids) == 6 for c in comps)
    assert len({tuple(c.token_ids) for c in comps}) == 3


def test_stop_strings_stop_ids_and_eos(llm):
    greedy = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    text = greedy[0].outputs[0].text
    stop = text[5:8]
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=10, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == text[: text.index(stop)]
    inc = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=10, stop=stop,
                                                            include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert inc.text == text[: text.index(stop) + len(stop)]
    tok = greedy[0].outputs[0].token_ids[2]
    sid = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[tok]),
                       use_tqdm=False)[0].outputs[0]
    assert sid.finish_reason == "stop" and sid.stop_reason == tok and sid.token_ids[-1] == tok
    assert len(sid.token_ids) == greedy[0].outputs[0].token_ids.index(tok) + 1
    # min_tokens masks the stop id until it is reached.
    mt = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[tok],
                                                           min_tokens=5), use_tqdm=False)[0].outputs[0]
    assert len(mt.token_ids) >= 5 and tok not in mt.token_ids[:5]


def test_eos_ids_from_config_and_generation_config():
    llm = LLM(device="cpu", dtype="float32", max_model_len=64, enable_trace_replay=True)
    eos = llm.llm_engine.model_config.eos_token_ids
    assert eos == (151645, 151643)
    out = llm.generate(["Hi"], SamplingParams(trace_decode_token_ids=[5, 151645, 7]), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [5, 151645, 7]  # a trace runs through EOS


def test_prompt_logprobs_match_hf(tiny_models):
    llm = LLM(tiny_models["llama"], device="cpu", dtype="float32", max_model_len=128, skip_tokenizer_init=True,
              max_num_batched_tokens=8)  # chunked prefill: prompt logprobs arrive in pieces
    prompt = [5, 17, 99, 3, 250, 41, 7, 8, 9, 10, 11, 300, 2, 77]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    import torch

    hf = load_hf(tiny_models["llama"])
    with torch.no_grad():
        lp = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert abs(entry[prompt[i]].logprob - float(lp[i - 1, prompt[i]])) <= LOGPROB_TOL  # engine vs transformers
        assert entry[prompt[i]].rank == hf_rank(lp[i - 1], prompt[i])
        assert len(entry) <= 3


def test_bad_words_and_penalties_change_output(llm):
    base = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    text = base[0].outputs[0].text
    first_word = llm.get_tokenizer().decode(base[0].outputs[0].token_ids[:1]).strip()
    banned = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=6, bad_words=[first_word]),
                          use_tqdm=False)[0].outputs[0]
    assert banned.token_ids[0] != base[0].outputs[0].token_ids[0]
    rep = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=6, repetition_penalty=5.0,
                                                            presence_penalty=2.0), use_tqdm=False)[0].outputs[0]
    assert len(set(rep.token_ids)) == len(rep.token_ids)  # strong penalties: no token repeats
    assert text  # detokenized


def test_chat_and_skip_tokenizer_init():
    llm = LLM(device="cpu", dtype="float32", max_model_len=128)
    out = llm.chat([{"role": "user", "content": "Hi there"}], SamplingParams(temperature=0, max_tokens=3),
                   use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids[:1] == [tok.convert_tokens_to_ids("<|im_start|>")]
    assert out.prompt_token_ids[-3:] == tok.encode("<|im_start|>assistant\n")
    assert llm.llm_engine.get_tokenizer() is tok  # vLLM's LLMEngine.get_tokenizer
    raw = LLM(device="cpu", dtype="float32", max_model_len=128, skip_tokenizer_init=True)
    assert raw.get_tokenizer() is None and raw.llm_engine.get_tokenizer() is None
    o = raw.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(o[0].outputs[0].token_ids) == 2 and o[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        raw.generate("text", use_tqdm=False)


def test_abort_mid_generation_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("x", "Once upon a time", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("x2", "Once upon a time", SamplingParams(max_tokens=50, n=3, seed=1))  # one parent of 3
    assert engine.get_num_unfinished_requests() == 2  # vLLM's LLMEngine count: parents
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert engine.abort_request("x2") and engine.get_num_unfinished_requests() == 1
    assert engine.abort_request("x") and not engine.abort_request("x")
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("y", "a", SamplingParams())
        engine.add_request("y", "a", SamplingParams())
    engine.abort_request("y")


def test_step_outputs_are_snapshots(llm):
    engine = llm.llm_engine
    engine.add_request("snap", "Once upon a time", SamplingParams(temperature=0, max_tokens=4))
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            first = first or out
    assert len(first.outputs[0].token_ids) == 1  # later steps did not grow the first output


def test_mixed_greedy_and_sampled_batch_matches_solo(llm):
    sampled = SamplingParams(temperature=0.8, top_k=50, max_tokens=5, seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=5)
    both = llm.generate(["Once upon a time", "Hello"], [sampled, greedy], use_tqdm=False)
    solo_s = llm.generate(["Once upon a time"], sampled, use_tqdm=False)[0]
    solo_g = llm.generate(["Hello"], greedy, use_tqdm=False)[0]
    assert both[0].outputs[0].token_ids == solo_s.outputs[0].token_ids
    assert both[1].outputs[0].token_ids == solo_g.outputs[0].token_ids


def test_generate_freezes_the_heap_only_for_its_run(tiny_models, monkeypatch):
    # Objects alive before generate() sit in the collector's permanent generation during the run (full
    # collections skip them) and are handed back afterwards; a heap someone else froze stays as it was.
    import gc

    llm = LLM(tiny_models["qwen3"], device="cpu", max_model_len=64, skip_tokenizer_init=True)
    seen = []
    real_step = llm.llm_engine.step

    def step():
        seen.append(gc.get_freeze_count())
        return real_step()

    monkeypatch.setattr(llm.llm_engine, "step", step)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert gc.get_freeze_count() == 0
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert seen and all(n > 0 for n in seen) and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        llm.generate([{"prompt_token_ids": [5, 6, 8]}], params, use_tqdm=False)
        # Not unfrozen behind the caller's back (a few frozen objects may die meanwhile: refcounts still work).
        assert gc.get_freeze_count() > frozen - 100
    finally:
        gc.unfreeze()
