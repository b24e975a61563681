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

from ..embedded_model import is_embedded

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
    if out.pop("revision", None) not in (None, "main"):
        raise ValueError(f"revision={kwargs['revision']!r} is not supported: a hub model is loaded at its default "
                         "branch; download that revision to a folder and pass the folder as model")
    if out.pop("download_dir", None) is not None and not (model is None or is_embedded(model)
                                                          or os.path.isdir(model)):
        raise ValueError("download_dir is not supported for a hub model: it is read from and downloaded to the "
                         f"Hugging Face cache; set HF_HUB_CACHE={kwargs['download_dir']} instead")
    capture = out.pop("max_seq_len_to_capture", None)
    if capture is not None and (isinstance(capture, bool) or not isinstance(capture, int) or capture < 1):
        raise ValueError(f"max_seq_len_to_capture must be an int >= 1, got {capture!r}")
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
    if dtype is not None and not isinstance(dtype, str) and type(dtype).__name__ == "dtype":  # a torch.dtype
        name = str(dtype).removeprefix("torch.")
        if name not in _DTYPE_NAMES:
            raise ValueError(f"dtype {dtype} is not supported: give float32, bfloat16 or float16")
        out["dtype"] = _DTYPE_NAMES[name]
    if "seed" in out and out["seed"] is None:
        out["seed"] = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    return out
