"""What scripts written for vLLM's offline LLM do: constructor options whose value changes nothing here (taken)
or asks for what this engine cannot do (a ValueError), a torch dtype, seed=None; LLM.chat with tools, content
parts and the rendered prompt in the output; generate's lora_request / priority / a tqdm class; vLLM's other
RequestOutput fields; prompt dict keys this engine does not read (a ValueError, never dropped); stop strings
without a tokenizer; "off" values of trace-incompatible options with a trace."""

from __future__ import annotations

import pytest
import torch

from replayllm import LLM, SamplingParams

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype=torch.float32, max_model_len=256, trust_remote_code=True, seed=None,
               disable_log_stats=True, tokenizer_mode="auto", pipeline_parallel_size=1, enable_lora=False,
               task="generate", swap_space=4, cpu_offload_gb=0, revision="main", download_dir="/tmp/x",
               max_seq_len_to_capture=8192)


def test_vllm_options_are_taken_or_refused(llm):
    assert llm.llm_engine.config.dtype == "float32"
    for bad, word in ((dict(enable_lora=True), "LoRA"), (dict(pipeline_parallel_size=2), "pipeline"),
                      (dict(tokenizer_mode="slow"), "tokenizer"), (dict(cpu_offload_gb=4), "offload"),
                      (dict(task="embed"), "generative"), (dict(trust_remote_code="yes"), "bool"),
                      (dict(swap_space=-1), "swap_space"), (dict(dtype=torch.int8), "dtype"),
                      (dict(revision="v2"), "revision"), (dict(max_seq_len_to_capture=0), "capture")):
        with pytest.raises(ValueError, match=word):
            LLM(device="cpu", max_model_len=64, load_format="dummy", **bad)
    with pytest.raises(ValueError, match="HF_HUB_CACHE"):
        LLM("someone/some-model", device="cpu", download_dir="/tmp/x")
    with pytest.raises(TypeError):
        LLM(device="cpu", max_model_len=64, load_format="dummy", no_such_option=1)


def test_seed_none_draws_a_seed():
    seeds = {LLM(device="cpu", max_model_len=64, load_format="dummy", seed=None).llm_engine.config.seed
             for _ in range(2)}
    assert len(seeds) == 2 and all(isinstance(s, int) and s >= 0 for s in seeds)


def test_chat_with_tools_content_parts_and_the_rendered_prompt(llm):
    sp = SamplingParams(temperature=0, max_tokens=2)
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "you"}]}],
                     sp, use_tqdm=False, tools=TOOLS)[0]
    joined = llm.chat([{"role": "user", "content": "Hi\nyou"}], sp, use_tqdm=False, tools=TOOLS)[0]
    plain = llm.chat([{"role": "user", "content": "Hi\nyou"}], sp, use_tqdm=False)[0]
    assert parts.prompt_token_ids == joined.prompt_token_ids != plain.prompt_token_ids
    assert "get_weather" in parts.prompt and "get_weather" not in plain.prompt
    tok = llm.get_tokenizer()
    assert tok.encode(parts.prompt, add_special_tokens=False) == parts.prompt_token_ids
    none = llm.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                     {"role": "user", "content": "again"}], sp, use_tqdm=False)[0]
    assert none.outputs[0].token_ids
    with pytest.raises(ValueError, match="text only"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], sp)


def test_generate_takes_vllm_keywords_and_refuses_what_it_cannot_do(llm):
    sp = SamplingParams(temperature=0, max_tokens=2)
    calls = []

    class Bar:
        def __init__(self, **kwargs):
            calls.append(kwargs["total"])

        def update(self, n):
            calls.append(n)

        def close(self):
            calls.append("closed")

    out = llm.generate(["a", "b"], sp, use_tqdm=Bar, lora_request=None, priority=[0, 0])
    assert len(out) == 2 and calls[0] == 2 and calls[-1] == "closed"
    assert (out[0].metrics, out[0].lora_request, out[0].encoder_prompt, out[0].kv_transfer_params) == (None,) * 4
    assert out[0].outputs[0].lora_request is None  # CompletionOutput's too (vLLM's)
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate("a", sp, lora_request=object())
    with pytest.raises(ValueError, match="first-come"):
        llm.generate(["a"], sp, priority=[1])
    with pytest.raises(ValueError, match="lengths of prompts"):  # vLLM's check: one priority per prompt
        llm.generate(["a"], sp, priority=[0, 0])


def test_cache_salt_keeps_prefix_cache_blocks_apart(llm):
    """vLLM's cache_salt: a prompt's cached blocks are reused only by prompts with the same salt (or none)."""
    sp = SamplingParams(temperature=0, max_tokens=1)
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)

    def cached(**salt):
        return llm.generate({"prompt": prompt, **salt}, sp, use_tqdm=False)[0].num_cached_tokens

    cached()
    assert cached() > 0  # the same prompt again: its blocks from the cache
    assert cached(cache_salt="tenant-a") == 0  # salted: none of the unsalted blocks
    assert cached(cache_salt="tenant-a") > 0 and cached(cache_salt="tenant-b") == 0
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        cached(cache_salt="")


@pytest.mark.parametrize(("key", "word"), [("multi_modal_data", "text only"), ("prompt_embeds", "text only"),
                                           ("nope", "unknown prompt keys")])
def test_prompt_keys_this_engine_does_not_read_are_refused(llm, key, word):
    with pytest.raises(ValueError, match=word):
        llm.generate({"prompt": "hi", key: {}}, SamplingParams(max_tokens=1))
    assert not llm.llm_engine.has_unfinished_requests()


def test_stop_strings_need_a_tokenizer():
    bare = LLM(device="cpu", max_model_len=64, load_format="dummy", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="stop_token_ids"):
        bare.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2, stop=["a"]))


def test_off_values_of_trace_incompatible_options_go_with_a_trace():
    p = SamplingParams(trace_decode_token_ids=[1, 2], thinking_token_budget=-1,
                       repetition_detection={"max_pattern_size": 0})
    assert p.thinking_token_budget is None and p.repetition_detection is None
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(trace_decode_token_ids=[1, 2], thinking_token_budget=0)


def test_min_tokens_past_the_room_left_is_refused_not_lowered(llm):
    n = len(llm.get_tokenizer().encode("hi"))
    room = 256 - n
    out = llm.generate("hi", SamplingParams(min_tokens=room, ignore_eos=True, max_tokens=None), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == room
    with pytest.raises(ValueError, match=f"min_tokens={room + 1} cannot be met"):
        llm.generate("hi", SamplingParams(min_tokens=room + 1, max_tokens=None))


def test_detokenize_false_leaves_logprobs_without_text(llm):
    """vLLM's detokenize=False: no text, and no decoded_token in logprobs or prompt_logprobs (the tokens were
    decoded before); the numbers are the same as with detokenize on."""
    params = dict(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    plain, = llm.generate("Once upon a time", SamplingParams(**params), use_tqdm=False)
    raw, = llm.generate("Once upon a time", SamplingParams(**params, detokenize=False), use_tqdm=False)
    comp = raw.outputs[0]
    assert comp.text == "" and comp.token_ids == plain.outputs[0].token_ids
    assert [{t: lp.decoded_token for t, lp in d.items()} for d in comp.logprobs] == \
        [{t: None for t in d} for d in plain.outputs[0].logprobs]
    assert any(lp.decoded_token for d in plain.outputs[0].logprobs for lp in d.values())
    assert [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in comp.logprobs] == \
        [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in plain.outputs[0].logprobs]
    assert all(lp.decoded_token is None for d in raw.prompt_logprobs[1:] for lp in d.values())
    assert any(lp.decoded_token for d in plain.prompt_logprobs[1:] for lp in d.values())


def test_generation_config_eos_ids_stop_with_their_stop_reason(llm):
    """vLLM's update_from_generation_config: generation_config.json's EOS ids other than the tokenizer's join
    stop_token_ids, so a stop on one reports it (the embedded model: <|im_end|> is the tokenizer's, its
    generation_config adds <|endoftext|>); the tokenizer's own EOS reports None; ignore_eos ignores both."""
    tok = llm.get_tokenizer()
    eos, other = tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")
    assert eos != other and {eos, other} <= set(llm.llm_engine.model_config.eos_token_ids)

    def run(token, **extra):
        params = SamplingParams(temperature=0, max_tokens=3, logit_bias={token: 100.0}, **extra)
        return llm.generate("hi", params, use_tqdm=False)[0].outputs[0]

    out = run(other)
    assert (out.token_ids, out.finish_reason, out.stop_reason, out.text) == ([other], "stop", other, "")
    out = run(eos)
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", None)
    out = run(eos, stop_token_ids=[eos])  # vLLM checks its EOS before the stop ids: still None
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", None)
    assert run(other, ignore_eos=True).token_ids == [other] * 3
    params = SamplingParams(max_tokens=2)
    llm.generate("hi", params, use_tqdm=False)
    assert params.stop_token_ids == []  # the caller's params are not changed


def test_vllms_input_types_and_from_optional(llm):
    """`from vllm.inputs import TokensPrompt` / `TextPrompt` and `SamplingParams.from_optional` (vLLM's)."""
    from replayllm.inputs import PromptType, TextPrompt, TokensPrompt  # noqa: F401

    ids = llm.get_tokenizer().encode("Once upon a time")
    params = SamplingParams.from_optional(temperature=0, max_tokens=3, top_p=None, seed=None, ignore_eos=True)
    assert params.top_p == 1.0 and params.seed is None and params.max_tokens == 3
    assert SamplingParams.from_optional(max_tokens=None).max_tokens is None
    by_ids, by_text = llm.generate([TokensPrompt(prompt_token_ids=ids), TextPrompt(prompt="Once upon a time")],
                                   params, use_tqdm=False)
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids and len(by_ids.outputs[0].token_ids) == 3


def test_model_config_has_vllm_engine_names(llm):
    """vLLM scripts read max_model_len (and model, seed, vocab size) from llm.llm_engine.model_config."""
    mc = llm.llm_engine.model_config
    assert llm.model_config is mc
    assert mc.max_model_len == 256 == llm.llm_engine.config.max_model_len
    assert mc.model == llm.llm_engine.config.model and mc.tokenizer == mc.model
    assert mc.seed == llm.llm_engine.config.seed and mc.max_logprobs == 20
    assert mc.get_vocab_size() == mc.vocab_size > 0 and mc.get_hidden_size() == mc.hidden_size
    assert mc.get_head_size() == mc.head_dim and mc.hf_text_config is mc.hf_config
    assert mc.eos_token_ids and mc.architecture  # the checkpoint's facts are still there


def test_the_tokenizers_eos_ends_a_request_where_the_config_names_another(llm, tmp_path):
    """vLLM's EOS is the tokenizer's: a fine-tune whose config.json (and generation_config.json) still name the base
    model's <|endoftext|> while its tokenizer ends turns with <|im_end|> stops on <|im_end|> (finish_reason stop,
    stop_reason None), in generate and in a structured request; ignore_eos ignores it."""
    import json
    import os

    from replayllm.structured_outputs import StructuredOutputsParams

    src = llm.llm_engine.model_config.path
    tok = llm.get_tokenizer()
    eos, stale = tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")
    for name in os.listdir(src):
        if name.endswith(".json") and "config" in name and "tokenizer" not in name:
            data = json.load(open(os.path.join(src, name)))
            data["eos_token_id"] = stale
            json.dump(data, open(tmp_path / name, "w"))
        else:
            os.symlink(os.path.join(src, name), tmp_path / name)
    tuned = LLM(str(tmp_path), device="cpu", dtype=torch.float32, max_model_len=64)
    assert tuned.llm_engine.eos_token_ids == (eos, stale) and tuned.model_config.eos_token_ids == (eos, stale)

    def run(**extra):
        params = SamplingParams(**{"temperature": 0, "max_tokens": 3, "logit_bias": {eos: 100.0}, **extra})
        return tuned.generate("hi", params, use_tqdm=False)[0].outputs[0]

    out = run()
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", None)
    assert run(ignore_eos=True).token_ids == [eos] * 3
    # a structured request ends on it once its grammar is complete (the matcher's stop tokens are the request's)
    out = run(structured_outputs=StructuredOutputsParams(choice=["a"]), max_tokens=8)
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos and out.text == "a"


def test_chat_takes_vllms_other_arguments(llm):
    """LLM.chat's lora_request / chat_template_content_format / mm_processor_kwargs (vLLM's): None and the
    content formats work, anything this engine cannot do is a ValueError."""
    sp = SamplingParams(temperature=0, max_tokens=1)
    conv = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "you"}]}]
    template = "{% for m in messages %}{{ m['content'] is string }}|{% endfor %}"
    kinds = {fmt: llm.chat(conv, sp, use_tqdm=False, chat_template=template, lora_request=None,
                           mm_processor_kwargs=None, chat_template_content_format=fmt)[0].prompt
             for fmt in ("auto", "string", "openai")}
    assert kinds == {"auto": "True|", "string": "True|", "openai": "False|"}
    for bad, word in ((dict(lora_request=object()), "LoRA"), (dict(mm_processor_kwargs={}), "text only"),
                      (dict(chat_template_content_format="html"), "content_format"),
                      (dict(chat_template_kwargs=[("a", 1)]), "must be a dict")):
        with pytest.raises(ValueError, match=word):
            llm.chat(conv, sp, use_tqdm=False, **bad)


def test_chat_template_kwargs_pass_documents_to_a_rag_template(llm):
    """vLLM passes chat_template_kwargs' documents on to the template (LLM.chat has no field of its own for it)."""
    template = ("{% for d in documents %}[{{ d['title'] }}]{% endfor %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    out = llm.chat([{"role": "user", "content": "q"}], SamplingParams(max_tokens=1), use_tqdm=False,
                   chat_template=template, chat_template_kwargs={"documents": [{"title": "A", "text": "x"}]})
    assert out[0].prompt == "[A]q"
