"""vLLM constructor options that EngineConfig has no field for, taken where their value asks for what this engine
does anyway (scripts written for vLLM pass them routinely), refused with a ValueError where it asks for something
this engine cannot do. Never accepted and dropped when the value would change anything.

| option | accepted | why it changes nothing here |
| --- | --- | --- |
| trust_remote_code | any bool | no checkpoint code is ever run (this package's own model files, or a refusal) |
| disable_log_stats | any bool | the offline LLM logs no periodic stats |
| swap_space | a number >= 0 | preemption recomputes (vLLM V1 does not swap either) |
| tokenizer_mode | "auto", "hf" | the tokenizer is always the checkpoint's fast (HF) tokenizer |
| pipeline_parallel_size | 1 | |
| cpu_offload_gb | 0 | |
| enable_lora | False | |
| task, runner | "auto", "generate" | a generative model is all this engine runs |
| revision | None, "main" | a hub model is loaded at its default branch (another: download it, pass the folder) |
| download_dir | any, for a local or the embedded model | nothing is downloaded (a hub model: set HF_HUB_CACHE) |
| max_seq_len_to_capture | an int >= 1 | CUDA graphs serve every context length up to max_model_len |

The same rules as `replayllm serve`'s flags (cli/serve_compat_args.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..embedded_model import DEFAULT_MODEL, is_embedded

DEFAULT_REVISION = "main"  # what a hub model resolves to (model_source.py)

_ONLY: dict[str, tuple] = {
    "tokenizer_mode": ("auto", "hf"),
    "pipeline_parallel_size": (1,),
    "cpu_offload_gb": (0,),
    "enable_lora": (False,),
    "task": ("auto", "generate"),
    "runner": ("auto", "generate"),
}
_WHY = {
    "tokenizer_mode": "the checkpoint's fast (HF) tokenizer is the only one",
    "pipeline_parallel_size": "no pipeline parallelism (tensor_parallel_size splits a model)",
    "cpu_offload_gb": "weights are not offloaded to the CPU",
    "enable_lora": "LoRA adapters are not supported",
    "task": "only generative models are served (no pooling / embedding runner)",
    "runner": "only generative models are served (no pooling / embedding runner)",
}
_DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
                "half": "float16"}


def take_vllm_options(model: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """kwargs without the vLLM-only options above (checked), with a torch.dtype `dtype` named and `seed=None`
    (vLLM's "no fixed seed") turned into a fresh random seed. ValueError for a value this engine cannot honour."""
    out = dict(kwargs)
    check_revision(out.pop("revision", None), "revision")
    download_dir_note(model, out.pop("download_dir", None), "download_dir")
    check_capture_len(out.pop("max_seq_len_to_capture", None), "max_seq_len_to_capture")
    for name in ("trust_remote_code", "disable_log_stats"):
        if name in out and not isinstance(out.pop(name), bool):
            raise ValueError(f"{name} must be a bool")
    if "swap_space" in out:
        value = out.pop("swap_space")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {value!r}")
    for name, allowed in _ONLY.items():
        if name in out:
            value = out.pop(name)
            if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
                raise ValueError(f"{name}={value!r} is not supported by replayllm ({_WHY[name]}); accepted: "
                                 f"{', '.join(map(repr, allowed))}")
    dtype = out.get("dtype")
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
        if name not in _DTYPE_NAMES:
            raise ValueError(f"dtype {dtype} is not supported: give float32, bfloat16 or float16")
        out["dtype"] = _DTYPE_NAMES[name]
    if "seed" in out and out["seed"] is None:
        out["seed"] = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    return out


def check_revision(revision: str | None, name: str) -> None:
    """Only the default branch (or none given): a ValueError saying how to serve another revision."""
    if revision is not None and revision != DEFAULT_REVISION:
        raise ValueError(f"{name} {revision}: not supported; replayllm loads a hub model at its default branch. "
                         f"Download that revision to a folder (huggingface-cli download MODEL --revision {revision} "
                         "--local-dir DIR) and serve DIR")


def download_dir_note(model: str | None, download_dir: str | None, name: str) -> str | None:
    """None when no download_dir is given; for a local (or the embedded) model the note that it has no effect; for
    a hub model a ValueError (the Hugging Face cache is where it goes: HF_HUB_CACHE)."""
    if download_dir is None:
        return None
    model = model if model is not None else DEFAULT_MODEL
    if not (os.path.isdir(model) or is_embedded(model)):
        raise ValueError(f"{name}: not supported; a hub model is read from and downloaded to the Hugging Face "
                         f"cache: set HF_HUB_CACHE={download_dir} instead")
    return f"{name} has no effect: the model {model!r} is local, nothing is downloaded"


def check_capture_len(value: int | None, name: str) -> None:
    """vLLM's max_seq_len_to_capture: an int >= 1 (no effect: CUDA graphs serve every length up to max_model_len)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be >= 1, got {value}")
