"""SamplingParams.truncate_prompt_tokens (vLLM's) through LLM.generate: the model sees the prompt's last k tokens
(token ids or text), exactly what the truncated prompt alone gives; -1 keeps max_model_len - 1; bad values are
ValueErrors naming the field. The server's routes: tests/server/test_request_fields.py."""

from __future__ import annotations

import pytest

from replayllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", max_model_len=64)


def _run(llm, prompt, **kw):
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=1, ignore_eos=True, **kw)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    return out.prompt_token_ids, out.outputs[0].token_ids, [lp[t].logprob for lp, t in
                                                             zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]


def test_token_ids_and_text_keep_their_last_k(llm):
    ids = [(11 * i) % 300 + 10 for i in range(100)]  # longer than max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        _run(llm, {"prompt_token_ids": ids})
    cut = _run(llm, {"prompt_token_ids": ids}, truncate_prompt_tokens=16)
    assert cut[0] == ids[-16:] and cut == _run(llm, {"prompt_token_ids": ids[-16:]})
    assert len(_run(llm, {"prompt_token_ids": ids}, truncate_prompt_tokens=-1)[0]) == 63
    short = _run(llm, {"prompt_token_ids": ids[:5]}, truncate_prompt_tokens=16)  # shorter than k: unchanged
    assert short[0] == ids[:5]
    text = "the quick brown fox jumps over the lazy dog " * 20  # ~180 tokens
    full = llm.get_tokenizer().encode(text)
    got = _run(llm, text, truncate_prompt_tokens=9)
    assert got[0] == full[-9:] and got == _run(llm, {"prompt_token_ids": full[-9:]})


@pytest.mark.parametrize("bad,match", [(0, "integer >= 1"), (-2, "integer >= 1"), (True, "integer >= 1"),
                                       (2.0, "integer >= 1"), (64, "less than max_model_len")])
def test_bad_values_name_the_field(llm, bad, match):
    with pytest.raises(ValueError, match=f"truncate_prompt_tokens.*{match}"):
        _run(llm, {"prompt_token_ids": [5, 6, 7]}, truncate_prompt_tokens=bad)
