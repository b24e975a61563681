"""vLLM's /tokenize and /detokenize on a real `replayllm serve` subprocess (the fixtures of test_server.py)."""

# ruff: noqa: F811 -- the fixtures are imported from test_server.py (one definition), so test arguments "redefine" them

from __future__ import annotations

from test_server import MODEL, PROMPT, client, llm, post, post_root, server, server_idle_after_each_test  # noqa: F401


def test_tokenize_prompt_equals_engine_tokenizer(server, llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT, add_special_tokens=True)
    assert post_root(server, "/tokenize", {"model": MODEL, "prompt": PROMPT}) == \
        {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    body = post_root(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True})
    assert body["tokens"] == tok.encode(PROMPT, add_special_tokens=False)
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"]) and len(body["token_strs"]) == body["count"]
    # The same ids /v1/completions prompts the model with.
    r = post(server, "/completions", {"prompt": PROMPT, "max_tokens": 1, "return_token_ids": True})
    assert r.json()["choices"][0]["prompt_token_ids"] == ids


def test_tokenize_reports_max_model_len_and_counts_past_it(server, client):
    long_text = "word " * 600
    body = post_root(server, "/tokenize", {"prompt": long_text})
    assert body["max_model_len"] == client.models.retrieve(MODEL).max_model_len == 512
    assert body["count"] == len(body["tokens"]) > 512  # counted, not refused: telling the caller is the point


def test_tokenize_chat_equals_chat_endpoint_prompt(server, llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story."}]
    body = post_root(server, "/tokenize", {"model": MODEL, "messages": messages, "return_token_strs": True})
    expected = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["token_strs"] == tok.convert_ids_to_tokens(expected)
    chat = post(server, "/chat/completions", {"messages": messages, "max_tokens": 1, "return_token_ids": True})
    assert chat.json()["prompt_token_ids"] == expected

    # vLLM's template options, as the chat endpoint takes them.
    prefill = [*messages, {"role": "assistant", "content": "Once upon"}]
    body = post_root(server, "/tokenize", {"messages": prefill, "add_generation_prompt": False,
                                           "continue_final_message": True})
    assert body["tokens"] == tok.apply_chat_template(prefill, tokenize=True, add_generation_prompt=False,
                                                     continue_final_message=True)["input_ids"]
    chat = post(server, "/chat/completions", {"messages": prefill, "add_generation_prompt": False,
                                              "continue_final_message": True, "max_tokens": 1,
                                              "return_token_ids": True})
    assert chat.json()["prompt_token_ids"] == body["tokens"]


def test_detokenize_round_trip(server, llm):
    tok = llm.get_tokenizer()
    for text in (PROMPT, "  two spaces,\ttab and\nnewline", "naïve café, Größe", "日本語のテキスト", "emoji 🙂🚀 end",
                 "<|im_start|>user\nhi<|im_end|>", ""):
        tokens = post_root(server, "/tokenize", {"prompt": text})["tokens"]
        assert tokens == tok.encode(text)
        assert post_root(server, "/detokenize", {"model": MODEL, "tokens": tokens}) == {"prompt": text}
    # Any ids, as the tokenizer decodes them (special tokens included).
    ids = [151644, 872, 198, 6023]
    assert post_root(server, "/detokenize", {"tokens": ids})["prompt"] == tok.decode(ids) == "<|im_start|>user\nhi"
