"""What the text of a finished sequence holds, as vLLM's detokenizer makes it: the token that ended it (EOS, a
stop_token_ids id) gives no text unless include_stop_str_in_output (its id stays in token_ids); a stop string is
found in the token that also hit max_tokens (finish "stop", not "length"); stop strings count only in text after
the first min_tokens tokens. Both paths: the in-process engine (OutputProcessor.process) and the API server's
side of the core's messages (ClientOutputRouter)."""

from __future__ import annotations

import asyncio
import time

import pytest

from replayllm import LLM, SamplingParams

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def greedy(llm):
    """The greedy continuation's ids and their texts, one by one."""
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    return out.token_ids, [tok.decode(out.token_ids[:i]) for i in range(len(out.token_ids) + 1)]


def _one(llm, **kw):
    return llm.generate(PROMPT, SamplingParams(temperature=0, **kw), use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_gives_no_text_unless_include_stop_str_in_output(llm, greedy, include):
    ids, texts = greedy
    out = _one(llm, max_tokens=8, stop_token_ids=[ids[3]], include_stop_str_in_output=include)
    assert out.token_ids == ids[:4] and out.finish_reason == "stop" and out.stop_reason == ids[3]
    assert out.text == texts[4 if include else 3]


def test_an_eos_token_gives_no_text_even_with_special_tokens_kept(llm):
    eos = llm.get_tokenizer().convert_tokens_to_ids("<|im_end|>")
    assert eos in llm.llm_engine.model_config.eos_token_ids
    out = _one(llm, max_tokens=3, logit_bias={eos: 100.0}, skip_special_tokens=False)
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""
    kept = _one(llm, max_tokens=3, logit_bias={eos: 100.0}, skip_special_tokens=False,
                include_stop_str_in_output=True)
    assert kept.text == "<|im_end|>"


def test_a_stop_string_in_the_last_allowed_token_wins_over_the_length_limit(llm, greedy):
    ids, texts = greedy
    word = texts[3][len(texts[2]):].strip()  # the third token's text
    assert word and word not in texts[2]
    out = _one(llm, max_tokens=3, stop=[word])
    assert out.finish_reason == "stop" and out.stop_reason == word and out.text == texts[3][:texts[3].index(word)]


def test_min_tokens_holds_stop_strings_back(llm, greedy):
    ids, texts = greedy
    first = texts[1].strip()
    assert first
    stopped = _one(llm, max_tokens=8, stop=[first])
    assert len(stopped.token_ids) == 1 and stopped.finish_reason == "stop"
    held = _one(llm, max_tokens=8, min_tokens=5, stop=[first])
    assert held.token_ids == ids and held.finish_reason == "length" and held.text == texts[8]


class _FakeClient:
    def __init__(self):
        from replayllm.engine.engine_stats import StatsSink

        self.stats, self.snapshot, self.core_aborts = StatsSink(), None, []

    def send_abort(self, ids):
        self.core_aborts.extend(ids)

    def abort(self, ids):
        pass


def test_the_api_server_side_drops_the_stop_tokens_text_and_finds_stop_strings_in_the_last_token(llm, greedy):
    """The core's messages: "e" ended by a stop token (text without it), "k" the same with include_stop, "l" ended
    by length in the token that completes a stop string (finish "stop", nothing to abort in the core)."""
    from replayllm.engine.client_outputs import ClientOutputRouter
    from replayllm.engine.core_messages import ENCODER, OUTPUTS_DECODER, CoreOutputs
    from replayllm.engine.request_stream import RequestStream, Tracked

    ids, texts = greedy
    word = texts[3][len(texts[2]):].strip()
    inputs = llm.llm_engine.input_processor
    fake = _FakeClient()
    router = ClientOutputRouter(inputs, fake)
    params = {"e": SamplingParams(max_tokens=8), "k": SamplingParams(max_tokens=8, include_stop_str_in_output=True),
              "l": SamplingParams(max_tokens=3, stop=[word])}
    ends = {"e": ("stop", ids[2]), "k": ("stop", None), "l": ("length", None)}

    async def main():
        loop = asyncio.get_running_loop()
        streams = {}
        for rid, p in params.items():
            streams[rid] = RequestStream(fake, [rid], loop)
            router.add(rid, inputs.prepare_request({"prompt_token_ids": [1, 2, 3]}, p),
                       Tracked(streams[rid], 0, 1, time.monotonic()))
        for step in range(3):
            rids = list(params)
            finished = [(rid, *ends[rid]) for rid in rids] if step == 2 else []
            msg = CoreOutputs(req_ids=rids, token_ids=[ids[step]] * 3, num_cached_tokens=[0] * 3, logprob=[],
                              rank=[], topk_ids=[], topk_logprobs=[], finished=finished,
                              step_started=time.monotonic(), step_ended=time.monotonic(), num_step_reqs=3,
                              num_step_tokens=3)
            router.apply(OUTPUTS_DECODER.decode(ENCODER.encode(msg)))
        last = {}
        for rid, s in streams.items():
            last[rid] = [out async for _, out in s.outputs()][-1].outputs[0]
        return last

    outs = asyncio.run(main())
    assert outs["e"].text == texts[2] and outs["e"].token_ids == ids[:3] and outs["e"].stop_reason == ids[2]
    assert outs["k"].text == texts[3]
    assert (outs["l"].finish_reason, outs["l"].stop_reason) == ("stop", word)
    assert outs["l"].text == texts[3][:texts[3].index(word)]
    assert fake.core_aborts == []  # the core had ended all three itself
