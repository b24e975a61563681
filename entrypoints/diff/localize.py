"""Layer localisation: the residual stream after each decoder sub-block on both sides, and where they part."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .results import LayerDiff, Localization, TokenDiff
from .sides import DiffRequest, free_device_memory, hf_model_options, hf_settings, load_hf_model
from .spec import ENGINE, HF, SideSpec, SpecError, engine_kwargs

# A checkpoint "jumps" when its relative difference exceeds JUMP_FACTOR × the largest one of the checkpoints
# before it, and at least MIN_JUMP (below that, fp32 kernels' rounding differences are not a finding).
JUMP_FACTOR, MIN_JUMP = 10.0, 1e-4


def pick_positions(tokens: list[TokenDiff], n: int) -> list[tuple[str, int]]:
    """At most n (request, position): the argmax flips first (earliest positions first, over all requests), then
    the largest |Δ|."""
    flips = sorted((t for t in tokens if t.argmax_agree is False), key=lambda t: t.position)
    rest = sorted((t for t in tokens if t.argmax_agree is not False), key=lambda t: abs(t.delta), reverse=True)
    return [(t.request_id, t.position) for t in (flips + rest)[:n]]


def check_localizable(name: str, spec: SideSpec) -> None:
    if spec.kind not in (ENGINE, HF):
        raise SpecError(f"--localize needs both sides to run a model; side {name} ({spec.text!r}) is a trace file")
    if spec.kind == ENGINE and spec.options.get("tensor_parallel_size", 1) != 1:
        raise SpecError(f"--localize does not support tensor_parallel_size > 1 (side {name}, {spec.text!r})")


def localize(sides: tuple[SideSpec, SideSpec], requests: list[DiffRequest], positions: list[tuple[str, int]],
             model: str | None) -> Localization:
    """Capture every checkpoint at `positions` on both sides (one side at a time) and compare them."""
    wanted: dict[str, list[int]] = {}
    for rid, pos in positions:
        wanted.setdefault(rid, []).append(pos)
    chosen = [r for r in requests if r.id in wanted]
    streams = []
    for spec in sides:
        rows: dict[tuple[str, int], np.ndarray] = {}  # (request, position) -> [C, H or V] per checkpoint
        for req, captured in zip(chosen, _capture(spec, chosen, wanted, model)):
            for pos in wanted[req.id]:
                rows[(req.id, pos)] = captured[pos]
        streams.append(rows)
    names = _checkpoint_names((len(next(iter(streams[0].values()))) - 3) // 2)
    diffs = []
    for c, (name, layer, part) in enumerate(names):
        a = np.stack([streams[0][p][c] for p in positions]).astype(np.float64)
        b = np.stack([streams[1][p][c] for p in positions]).astype(np.float64)
        norm = np.linalg.norm(a)
        diffs.append(LayerDiff(name, layer, part, float(np.linalg.norm(a - b) / norm) if norm else 0.0))
    return Localization(list(positions), diffs, first_jump(diffs), JUMP_FACTOR, MIN_JUMP)


def first_jump(diffs: list[LayerDiff], factor: float = JUMP_FACTOR, minimum: float = MIN_JUMP) -> LayerDiff | None:
    floor = 0.0
    for d in diffs:
        if d.rel_diff > max(factor * floor, minimum):
            return d
        floor = max(floor, d.rel_diff)
    return None


def _checkpoint_names(num_layers: int) -> list[tuple[str, int | None, str]]:
    names: list[tuple[str, int | None, str]] = [("embedding", None, "embedding")]
    for i in range(num_layers):
        names += [(f"layer {i} attention", i, "attention"), (f"layer {i} mlp", i, "mlp")]
    return names + [("final norm", None, "final norm"), ("logits", None, "logits")]


# -- capturing one side ------------------------------------------------------------------------------------
def _config_scale(lm, name: str) -> float:
    """Granite's residual_multiplier (1.0 for the other architectures)."""
    return float(getattr(getattr(lm, "config", None), name, None) or 1.0)


# hybrid models' linear-attention blocks, engine's and transformers' names (NemotronH's `mixer` holds every kind)
_LINEAR_BLOCKS = ("mamba", "linear_attn", "conv", "mixer")


# architectures whose residual stream is not embedding + the sub-blocks' outputs layer by layer
_UNREBUILT = {"BeamForCausalLM": "its residual stream is depth-scaled (each sub-block's output and the stream times "
                                 "their own factors), which the rebuilt stream (a plain sum) does not follow",
              "HrmTextForCausalLM": "its two stacks' layers run several times a token, so a layer's output is not one "
                                    "step of one residual stream",
              "MiniMaxForCausalLM": "each layer's residual is its normed input, the sums weighed by alpha / beta "
                                    "factors, which the rebuilt stream (a plain sum) does not follow",
              "HYV4ForCausalLM": "its residual is hc_mult hyper-connection streams, each block's output spread over "
                                 "them by per-token weights, which the rebuilt stream (a plain sum) does not follow",
              "InklingForCausalLM": "each block's output reaches the residual through a short convolution over the "
                                    "request's tokens, which the rebuilt stream (a plain sum) does not follow"}

class _Recorder:
    """Hooks on the first layer's input (the embeddings as the residual stream starts from them: Granite's
    multiplier and Gemma's sqrt(H) applied, wherever a side applies them), every layer's self_attn and mlp, the
    decoder stack (final norm output) and lm_head; rows land by absolute position. The residual stream is rebuilt
    from the sub-block outputs (embedding + Σ attention and MLP outputs, in float32), the same way on both
    sides."""

    def __init__(self, lm, num_positions: int, engine: bool):
        self.engine, self.positions = engine, None
        # transformers' GPT-NeoX names its parts apart: gpt_neox / embed_in / embed_out / attention, GPT-2 too:
        # transformer / h / attn (Falcon's: self_attention); a multimodal model keeps its decoder stack in
        # model.language_model
        stack = getattr(lm, "model", None) or getattr(lm, "gpt_neox", None) or lm.transformer
        stack = getattr(stack, "language_model", None) or stack
        head = getattr(lm, "lm_head", None) or lm.embed_out
        why = _UNREBUILT.get(type(lm).__name__)  # transformers' and the engine's classes share the names
        if why:
            raise SpecError(f"--localize does not support {type(lm).__name__} yet: {why}")
        layers = getattr(stack, "layers", None) or stack.h
        self.layers = len(layers)
        self.parts: dict[str, dict[int, np.ndarray]] = {}
        self.handles = [stack.register_forward_pre_hook(self._positions, with_kwargs=True),
                        layers[0].register_forward_pre_hook(self._layer_input, with_kwargs=True),
                        stack.register_forward_hook(self._keep("norm")),
                        head.register_forward_hook(self._keep("logits", last=True))]
        for i, layer in enumerate(layers):
            if engine and hasattr(layer, "ln_1"):  # OpenAI GPT: norms after the residual adds
                raise SpecError(f"--localize does not support {type(lm).__name__} yet: layer {i} norms after its "
                                "residual adds (post-norm), which the rebuilt residual stream does not follow")
            if hasattr(layer, "mlps"):  # LongCat-Flash: two attention + MLP sub-layers a block and a shortcut MoE
                raise SpecError(f"--localize does not support {type(lm).__name__} yet: layer {i} holds two attention "
                                "sub-layers and a shortcut MoE, which its split per layer (attention, MLP) cannot name")
            if getattr(layer, "altup", None) is not None:  # Gemma 3n: the layer's change is spread over n streams
                raise SpecError(f"--localize does not support {type(lm).__name__} yet: layer {i} runs AltUp, whose "
                                "streams its rebuilt residual stream (embedding + sub-block outputs) does not follow")
            linear = [n for n in _LINEAR_BLOCKS if getattr(layer, n, None) is not None]
            if linear:  # the stream is not embedding + attention + MLP outputs there
                raise SpecError(f"--localize does not support {type(lm).__name__} yet: layer {i} runs a "
                                f"linear-attention block ({linear[0]}) that its rebuilt residual stream does not "
                                "follow (hybrid models: docs/hybrid_models.md)")
            # OLMo2 and GLM-4 norm each sub-block's output before the residual add (OLMo2's post_attention_layernorm
            # and post_feedforward_layernorm, GLM-4's post_self_attn_layernorm and post_mlp_layernorm): those
            # outputs are what the residual stream adds.
            if hasattr(layer, "post_feedforward_layernorm"):
                attn, mlp = layer.post_attention_layernorm, layer.post_feedforward_layernorm
            elif hasattr(layer, "post_mlp_layernorm"):
                attn, mlp = layer.post_self_attn_layernorm, layer.post_mlp_layernorm
            else:
                attn = (getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
                        or getattr(layer, "self_attention", None) or layer.attn)  # Falcon's: self_attention
                mlp = layer.mlp
            # Granite scales each sub-block's output by residual_multiplier before the add.
            scale = _config_scale(lm, "residual_multiplier")
            self.handles += [attn.register_forward_hook(self._keep(f"attn{i}", scale=scale)),
                             mlp.register_forward_hook(self._keep(f"mlp{i}", scale=scale))]

    def _positions(self, module, args, kwargs):
        if self.engine:
            self.positions = args[1].tolist()
        else:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:  # a multimodal model hands its language model the embeddings [1, T, H]
                ids = kwargs["inputs_embeds"][..., 0]
            self.positions = list(range(ids.shape[-1]))

    def _layer_input(self, module, args, kwargs):
        """The first layer's hidden states: the engine's layers take (positions, x, residual), transformers'
        (hidden_states, ...)."""
        self._store("embed", args[1] if self.engine else kwargs.get("hidden_states", args[0] if args else None))

    def _keep(self, key: str, last: bool = False, scale: float = 1.0):
        def hook(module, args, output):
            if isinstance(output, tuple):
                output = output[0]
            out = getattr(output, "last_hidden_state", output)
            if scale != 1.0:
                out = out * scale  # the model's own op (model dtype), as its residual add sees it
            self._store(key, out, last)
        return hook

    def _store(self, key: str, out, last: bool = False) -> None:
        # A copy, never a view: a model may add into a sub-block's output in place after the hook (transformers'
        # Falcon: `mlp_output += attention_output`), and an fp32 CPU tensor's .float().cpu().numpy() shares its memory.
        rows = out.detach().float().reshape(-1, out.shape[-1]).cpu().numpy().copy()
        # lm_head sees only the rows that are scored: the last position of the step (batch of one request).
        positions = self.positions[-len(rows):] if last and self.engine else self.positions
        store = self.parts.setdefault(key, {})
        for p, row in zip(positions, rows):
            store[p] = row

    def rows(self, position: int) -> list[np.ndarray]:
        """Every checkpoint's vector at one absolute position: embedding, per layer after attention and after
        MLP (the residual stream), final norm, logits."""
        h = self.parts["embed"][position].copy()
        out = [h.copy()]
        for i in range(self.layers):
            h = h + self.parts[f"attn{i}"][position]
            out.append(h.copy())
            h = h + self.parts[f"mlp{i}"][position]
            out.append(h.copy())
        return out + [self.parts["norm"][position], self.parts["logits"][position]]

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _capture(spec: SideSpec, requests: list[DiffRequest], wanted: dict[str, list[int]],
             model: str | None) -> Iterator[dict[int, list[np.ndarray]]]:
    """Per request: trace position -> checkpoint vectors (at absolute position len(prompt) - 1 + position)."""
    if spec.kind == ENGINE:
        yield from _capture_engine(spec, requests, wanted, model)
    else:
        yield from _capture_hf(spec, requests, wanted, model)


def _capture_engine(spec, requests, wanted, model):
    import torch

    from replayllm.entrypoints.llm import LLM
    from replayllm.sampling_params import SamplingParams

    # Hooks do not run inside CUDA graphs, and a prefix-cache hit would skip the prompt's rows: both off.
    kwargs = {**engine_kwargs(spec, model, 0), "enforce_eager": True, "enable_prefix_caching": False}
    llm = LLM(**kwargs)
    try:
        lm = llm.llm_engine.runner.model
        for req in requests:  # one request per generate: every step's rows belong to it
            last = max(wanted[req.id])
            trace_token_ids = req.trace_token_ids[: last + 1]
            rec = _Recorder(lm, len(req.prompt_token_ids) + len(trace_token_ids), engine=True)
            try:
                with torch.no_grad():
                    llm.generate([{"prompt_token_ids": req.prompt_token_ids}],
                                 SamplingParams(trace_decode_token_ids=trace_token_ids, detokenize=False),
                                 use_tqdm=False)
            finally:
                rec.close()
            yield {p: rec.rows(len(req.prompt_token_ids) - 1 + p) for p in wanted[req.id]}
    finally:
        llm.llm_engine.shutdown()
        del llm
        free_device_memory()


def _capture_hf(spec, requests, wanted, model):
    import torch

    hf = load_hf_model(*hf_settings(spec, model), **hf_model_options(spec))
    try:
        for req in requests:
            trace_token_ids = req.trace_token_ids[: max(wanted[req.id]) + 1]
            ids = req.prompt_token_ids + trace_token_ids
            rec = _Recorder(hf, len(ids), engine=False)
            try:
                with torch.no_grad():
                    hf(torch.tensor([ids], device=hf.device))
            finally:
                rec.close()
            yield {p: rec.rows(len(req.prompt_token_ids) - 1 + p) for p in wanted[req.id]}
    finally:
        del hf
        free_device_memory()
