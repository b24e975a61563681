"""The API server's tokenizer pool (engine/tokenizer_pool.py): lanes, the busy rule, shutdown; the batch encode it
relies on gives transformers' ids; the helper process that counts a large body's lists."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from replayllm.config import EngineConfig
from replayllm.engine.tokenizer import encode_prompt, encode_texts, load_tokenizer, tokenize_bad_words
from replayllm.engine.tokenizer_pool import PoolClosedError, ServerBusyError, TokenizerPool, TokenizerPoolConfig
from replayllm.entrypoints.http.body_counts import BodyCounter
from replayllm.entrypoints.http.errors import APIError
from replayllm.entrypoints.http.limits import RequestLimits, check_raw_counts

TEXTS = ["Once upon a time", " leading space", "two  spaces\nand a newline\t", "Ünïcödé 漢字 🙂",
         "<|im_start|>user\nhi<|im_end|>", "", "a" * 3000]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(EngineConfig(model="replayllm/tiny-qwen3", device="cpu", dtype="float32",
                                       max_model_len=64))


@pytest.mark.parametrize("special", [True, False])
def test_batch_encode_gives_transformers_ids(tok, special):
    assert encode_texts(tok, TEXTS, special) == [tok.encode(t, add_special_tokens=special) for t in TEXTS]
    assert [encode_prompt(tok, t, special) for t in TEXTS] == [tok.encode(t, add_special_tokens=special)
                                                               for t in TEXTS]


def test_a_prompt_that_cannot_fit_is_refused_from_its_length(tok):
    n = len(tok.encode("word " * 100))
    with pytest.raises(ValueError, match=rf"prompt \({n} tokens\) is longer than max_model_len \(64\)"):
        encode_prompt(tok, "word " * 100, True, max_model_len=64)
    assert encode_prompt(tok, "word " * 10, True, max_model_len=64) == tok.encode("word " * 10)


def test_bad_words_as_before(tok):
    words = ["fox", " fox", "lived there", "漢字", "fox"]
    expected: list[list[int]] = []
    for word in words:  # the one-encode-per-variant rule, written out
        for variant in (word, " " + word.lstrip()):
            ids = tok.encode(variant, add_special_tokens=False)
            if ids and ids not in expected:
                expected.append(ids)
    assert tokenize_bad_words(tok, words) == expected


def test_small_jobs_pass_a_busy_large_lane_and_the_lane_is_bounded():
    pool = TokenizerPool(TokenizerPoolConfig(size=1, max_queued=1, small_input_chars=100))
    release = threading.Event()

    async def scenario():
        large = asyncio.create_task(pool.run(release.wait, 60, size=1000))
        while pool.large_jobs == 0:
            await asyncio.sleep(0.01)
        small = await asyncio.wait_for(pool.run(lambda x: x + 1, 41, size=10), 60)  # not behind the large one
        with pytest.raises(ServerBusyError, match="--tokenizer-pool-queue 1"):
            await pool.run(lambda: None, size=1000)
        release.set()
        return small, await asyncio.wait_for(large, 60)

    try:
        assert asyncio.run(scenario()) == (42, True)
        assert pool.large_jobs == 0
    finally:
        pool.shutdown()


def test_shutdown_fails_running_and_waiting_jobs_at_once():
    pool = TokenizerPool(TokenizerPoolConfig(size=1, max_queued=4))
    release = threading.Event()

    async def scenario():
        running = asyncio.create_task(pool.run(release.wait, 60, size=0))
        waiting = asyncio.create_task(pool.run(lambda: "never", size=0))
        await asyncio.sleep(0.2)
        pool.shutdown()
        pool.shutdown()  # idempotent (the server calls it when it starts stopping, and again at the end)
        results = await asyncio.wait_for(asyncio.gather(running, waiting, return_exceptions=True), 60)
        with pytest.raises(PoolClosedError):
            await pool.run(lambda: None, size=0)
        return results

    try:
        results = asyncio.run(scenario())
        assert all(isinstance(r, PoolClosedError) for r in results), results
    finally:
        release.set()  # the worker thread finishes its job and drops the result


@pytest.mark.parametrize("bad", [{"size": 0}, {"max_queued": -1}, {"small_input_chars": True}])
def test_pool_config_is_checked(bad):
    with pytest.raises(ValueError, match="tokenizer pool"):
        TokenizerPoolConfig(**bad)


def test_body_counter_counts_lists_in_a_helper_process():
    counter = BodyCounter()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}] * 5000, "stop": ["a", "b"], "n": 3,
            "prompt": [[1, 2], [3]]}
    skeleton = counter.skeleton(json.dumps(body).encode())
    assert {k: len(v) for k, v in skeleton.items() if k != "n"} == {"messages": 5000, "stop": 2, "prompt": 2}
    assert skeleton["n"] == 3 and skeleton["prompt"][0] == []
    assert counter.skeleton(b"not json") == {} and counter.skeleton(b"[1, 2]") == {}
    limits = RequestLimits(max_chat_messages=4096, max_sequences_per_request=5).resolved(64)
    with pytest.raises(APIError, match="too many entries in messages: 5000"):
        check_raw_counts(skeleton, limits)
    with pytest.raises(APIError, match=r"too many sequences \(2 prompt\(s\) x n=3\): 6"):
        check_raw_counts({**skeleton, "messages": []}, limits)
