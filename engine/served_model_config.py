"""ServedModelConfig: the checkpoint's facts (ModelConfig) plus the engine's choices that vLLM keeps on its
ModelConfig, so a vLLM script's `llm.llm_engine.model_config.max_model_len` (or `llm.model_config.max_model_len`)
reads the same here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import EngineConfig, ModelConfig


@dataclass(frozen=True)
class ServedModelConfig(ModelConfig):
    """A ModelConfig (every field of the checkpoint's) with vLLM's engine-level names beside them."""

    model: str = ""  # the model argument as given (`path` is the local folder it resolved to)
    tokenizer: str = ""  # the tokenizer argument, or the model's
    max_model_len: int = 0  # prompt + output tokens a request may hold (EngineConfig.max_model_len)
    seed: int = 0
    served_model_name: str = ""
    max_logprobs: int = 0

    @classmethod
    def of(cls, mc: ModelConfig, config: EngineConfig, eos_token_ids: tuple[int, ...]) -> ServedModelConfig:
        """eos_token_ids: the engine's (InputProcessor.eos_token_ids: the tokenizer's EOS first)."""
        facts = {f.name: getattr(mc, f.name) for f in dataclasses.fields(ModelConfig)}
        facts["eos_token_ids"] = eos_token_ids or mc.eos_token_ids
        return cls(**facts, model=config.model, tokenizer=config.tokenizer or config.model,
                   max_model_len=config.max_model_len, seed=config.seed,
                   served_model_name=config.served_model_name or config.model, max_logprobs=config.max_logprobs)

    # vLLM's ModelConfig getters that scripts call
    @property
    def hf_text_config(self):  # the language model's config (this build serves a wrapper's text model)
        return self.hf_config

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def get_hidden_size(self) -> int:
        return self.hidden_size

    def get_head_size(self) -> int:
        return self.head_dim

    def get_sliding_window(self) -> int | None:
        return self.sliding_window
