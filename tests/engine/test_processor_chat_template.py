"""A multimodal checkpoint's chat template: the processor's (chat_template.json) where the tokenizer has none
(engine/tokenizer.processor_chat_template), and a template that loops over a message's content (LLaVA's,
Idefics3's) given OpenAI's list of parts for a string content (entrypoints/chat_template.messages_for_template), as
vLLM does; LLM.chat and the server render through the same two steps."""

from __future__ import annotations

import json
import shutil

import pytest

from replayllm import LLM, SamplingParams
from replayllm.embedded_model import materialize
from replayllm.entrypoints.chat_template import iterates_content, messages_for_template

# LLaVA-1.5's template, cut down: each message's text parts after its role, images skipped
LLAVA = ("{% for message in messages %}{{ message['role'].upper() + ': ' }}{% for content in message['content'] | "
         "selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}{% endfor %}{% endfor %}"
         "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


@pytest.fixture(scope="module")
def processor_folder(tmp_path_factory):
    """The embedded model with its chat template moved from the tokenizer to the processor's chat_template.json."""
    folder = tmp_path_factory.mktemp("vlm") / "m"
    shutil.copytree(materialize("replayllm/tiny-qwen3"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": LLAVA}))
    return str(folder)


def test_the_processor_template_renders_string_contents(processor_folder):
    llm = LLM(processor_folder, device="cpu", dtype="float32", max_model_len=128)
    tok = llm.get_tokenizer()
    assert tok.chat_template == LLAVA
    out = llm.chat([{"role": "user", "content": "Hi there"}], SamplingParams(temperature=0, max_tokens=2),
                   use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode("USER: Hi there ASSISTANT:")  # the text reached the template


def test_content_format_detection():
    assert iterates_content(LLAVA)
    assert iterates_content("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}")
    assert not iterates_content("{% for m in messages %}{{ m.content }}{% endfor %}")
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None}]
    assert messages_for_template(messages, LLAVA) == [
        {"role": "user", "content": [{"type": "text", "text": "a"}]}, messages[1], messages[2]]
    # A template reading content as a string gets one: text parts joined with newlines (vLLM's), None as "".
    assert messages_for_template(messages, "{{ messages[0].content }}") == [
        messages[0], {"role": "user", "content": "b"}, {"role": "assistant", "content": ""}]
