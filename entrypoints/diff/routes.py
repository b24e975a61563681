"""A MoE side's routes in CompletionOutput.routed_experts' layout ([positions, num_layers, top_k] int16, -1 on a
dense layer): what transformers' routers chose (RouterRecorder), or a trace record's."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

ROUTE_DTYPE = np.int16  # as the engine captures them
# transformers' router module of sparse layer N: mlp.gate (Qwen-MoE, OLMoE, GLM-4-MoE, DeepSeek), mlp.router (GPT-OSS),
# block_sparse_moe.gate (Mixtral before transformers 5)
_ROUTER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(?:gate|router)$")
# architectures whose router sends a token to the top k of softmax(logits) (GPT-OSS: of the logits, the same ids);
# others (GLM-4-MoE's and DeepSeek-V3's grouped sigmoid with a correction bias, DeepSeek-V2's group-limited
# choice) only by their router's own ids
SOFTMAX_TOP_K = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM",
                 "GptOssForCausalLM", "GraniteMoeForCausalLM", "Qwen3VLMoeForConditionalGeneration")


def softmax_top_k_routes(mc) -> bool:
    """Whether `mc`'s architecture routes by the top k of softmax(router logits): then logits alone give its routes."""
    greedy_v2 = mc.architecture == "DeepseekV2ForCausalLM" and (
        getattr(mc.hf_config, "topk_method", None) or "greedy") == "greedy"
    return mc.architecture in SOFTMAX_TOP_K or greedy_v2


class RouterRecorder:
    """Forward hooks on a transformers MoE model's routers, keeping what each sparse layer's router returned in the
    last forward. transformers 5.x routers return (logits, weights, ids): the ids are the experts the model used,
    whatever its rule. A router that returns logits alone (older releases) gives routes only where the rule is the
    softmax top-k (`softmax_top_k`); otherwise `routes` is None: unknown, never guessed."""

    def __init__(self, model, moe_layers: Sequence[int], softmax_top_k: bool):
        routers = {int(m.group(1)): module for name, module in model.named_modules()
                   if (m := _ROUTER_NAME.search(name))}
        self.missing = [layer for layer in moe_layers if layer not in routers]
        self.routers = {layer: routers[layer] for layer in moe_layers if layer in routers}
        self.softmax_top_k = softmax_top_k
        self.outputs: dict[int, object] = {}
        self._hooks = []

    def __enter__(self) -> RouterRecorder:
        self._hooks = [module.register_forward_hook(lambda _m, _x, y, layer=layer: self.outputs.__setitem__(layer, y))
                       for layer, module in self.routers.items()]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def routes(self, top_k: int, num_layers: int, rows: int) -> np.ndarray | None:
        """The last forward's routes [rows, num_layers, top_k] (its first `rows` positions), or None where a sparse
        layer's choice is unknown (no router module found, or logits alone under another rule)."""
        if self.missing or len(self.outputs) != len(self.routers):
            return None
        out = np.full((rows, num_layers, top_k), -1, dtype=ROUTE_DTYPE)
        for layer, y in self.outputs.items():
            parts = y if isinstance(y, (tuple, list)) else (y,)
            ids = [t for t in parts if not t.is_floating_point() and t.dim() == 2 and t.shape[-1] == top_k]
            if ids:
                out[:, layer] = ids[0][:rows].cpu().numpy()
            else:
                logits = [t for t in parts if t.is_floating_point() and t.dim() == 2]  # [T, E]
                if not (self.softmax_top_k and logits):
                    return None
                probs = logits[0][:rows].float().softmax(-1)
                out[:, layer] = probs.topk(top_k, dim=-1).indices.cpu().numpy()
        return out


def record_routes(routed_experts: list | None) -> np.ndarray | None:
    """A trace record's stored routes (nested lists, validated by trace_schema) as an int16 array, or None."""
    return None if routed_experts is None else np.asarray(routed_experts, dtype=ROUTE_DTYPE)
