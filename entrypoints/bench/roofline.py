"""The bandwidth/compute floor of a benchmark run: decode steps move the weights plus every context token's
K/V once; prefill is counted as matrix FLOPs. Ceilings are the ones measured on the GPU the run uses
(`device_ceilings`: the lent H200 and H100; another GPU gets the H200's, and the result says so).

Mixture-of-experts models: a step reads only the experts its tokens were routed to. With B tokens of top-k routing
spread evenly over E experts (dummy weights route near-uniformly), a layer's expert is hit with probability
1 - (1 - k/E)^B, so a step reads that share of the expert weights (all of them from B ~ 4E/k tokens on); a prefill
token costs the FLOPs of its k experts only."""

from __future__ import annotations

from dataclasses import dataclass

from ...hybrid_facts import RecurrentShape

H200_COPY_BYTES_PER_S = 4.25e12  # device-to-device copy, bytes read + written, measured on the lent H200
H200_BF16_FLOPS = 7.9e14  # 8192^3 bf16 matmul through torch, random data, measured there


@dataclass(frozen=True)
class Ceilings:
    """What a GPU can do at most, measured on it through torch: device-to-device copy bandwidth (bytes read +
    written per second, a 1 GiB copy) and bf16 matmul FLOP/s (8192^3, random data)."""

    device: str  # the GPU these were measured on, or what the run assumed
    copy_bytes_per_s: float
    bf16_flops: float

    def as_dict(self) -> dict:
        return {"device": self.device, "copy_bytes_per_s": self.copy_bytes_per_s, "bf16_flops": self.bf16_flops}


# torch.cuda.get_device_name() -> its measured ceilings. Names are matched whole: an "H100 PCIe" (2.0 TB/s) or an
# "H100 NVL" must not take the SXM card's numbers.
MEASURED_CEILINGS = {
    "NVIDIA H200": Ceilings("NVIDIA H200", H200_COPY_BYTES_PER_S, H200_BF16_FLOPS),
    # session 36, the lent H100 SXM: best of 5 x 20 copies of 1 GiB; best of 5 x 10 8192^3 matmuls
    "NVIDIA H100 80GB HBM3": Ceilings("NVIDIA H100 80GB HBM3", 3.015e12, 7.8e14),
}


def ceilings_for(device_name: str) -> Ceilings:
    """The ceilings measured on `device_name`; for a GPU not measured, the H200's, named as assumed."""
    if device_name in MEASURED_CEILINGS:
        return MEASURED_CEILINGS[device_name]
    return Ceilings(f"NVIDIA H200 (assumed: none measured on {device_name})", H200_COPY_BYTES_PER_S, H200_BF16_FLOPS)


def ceilings_note(result: dict) -> str:
    """", on DEVICE's ceilings" for a bench result's summary line ("" for a result without them)."""
    c = result.get("roofline_ceilings")
    return f", on {c['device']}'s ceilings" if c else ""


def device_ceilings(device=None) -> Ceilings:
    """The ceilings of the CUDA device a run uses (`device`: a torch.device or index; default the current one);
    off CUDA the H200's, named as assumed."""
    import torch

    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return ceilings_for("no CUDA device")
    return ceilings_for(torch.cuda.get_device_name(device))


@dataclass(frozen=True)
class ModelCost:
    """What one token costs a model: bytes of weights read per decode step, K/V bytes per context token
    (every layer with a KV cache, K and V), and matrix FLOPs per prefill token (2 x the decoder layers' weights)."""

    weight_bytes: int  # every weight read once per step, routed experts excluded
    kv_bytes_per_token: int
    flops_per_token: int  # routed experts: their top_k / num_experts share
    head_flops: int  # 2 x lm_head weights: paid once per sampled token
    expert_bytes: int = 0  # MoE: the routed experts' weights, all layers (read as far as tokens hit them)
    expert_hit_rate: float = 0.0  # MoE: top_k / num_experts, one token's chance to hit a given expert
    # hybrid models (docs/hybrid_models.md): a request's recurrent state, read and written back by every step
    state_bytes_per_request: int = 0

    def weight_bytes_read(self, tokens: int) -> float:
        """Weights one step over `tokens` tokens reads: the dense ones, and the experts' expected hit share."""
        return self.weight_bytes + self.expert_bytes * (1.0 - (1.0 - self.expert_hit_rate) ** tokens)

    @classmethod
    def of_engine(cls, engine) -> ModelCost:
        """From a built LLMEngine (rank 0's shard under tensor parallelism, times the TP size)."""
        model = engine.runner.model
        tp = engine.config.tensor_parallel_size
        mc = engine.model_config
        hit = mc.num_experts_per_tok / mc.num_experts if mc.is_moe else 0.0
        seen, weight_bytes, layer_flops, expert_bytes = set(), 0, 0.0, 0
        for name, p in model.named_parameters():
            if id(p) in seen:
                continue  # tied embedding / head: one tensor, read once
            seen.add(id(p))
            if ".experts." in name:  # the stacked routed experts (models/moe.py)
                expert_bytes += p.numel() * p.element_size()
                layer_flops += 2 * p.numel() * hit
                continue
            weight_bytes += p.numel() * p.element_size()
            if ".layers." in name:
                layer_flops += 2 * p.numel()
        head_params = model.lm_head.weight.numel()
        kv = sum(2 * heads * head_dim for heads, head_dim in map(mc.kv_shape, range(mc.num_kv_layers))
                 ) * engine.config.kv_cache_torch_dtype.itemsize
        state = 0
        if mc.recurrent_layers:
            state = 2 * len(mc.recurrent_layers) * RecurrentShape.of(mc.architecture, mc.hf_config).slot_bytes(
                mc.dtype.itemsize)  # all ranks' (the other figures are too)
        return cls(weight_bytes * tp, kv, int(layer_flops * tp), 2 * head_params * tp, expert_bytes * tp, hit, state)

    def run_seconds(self, num_prompts: int, input_len: int, output_len: int,
                    ceilings: Ceilings = MEASURED_CEILINGS["NVIDIA H200"]) -> float:
        """Floor for num_prompts x (input_len in, output_len out) on `ceilings`: prefill FLOPs at its bf16 rate
        (the first token comes from prefill), then output_len - 1 decode steps whose bytes go at its copy
        bandwidth; decode step i reads every request's input_len + i cached tokens."""
        prefill = (num_prompts * input_len * self.flops_per_token + num_prompts * self.head_flops) / ceilings.bf16_flops
        steps = output_len - 1
        context_tokens = num_prompts * (steps * input_len + steps * (steps + 1) // 2)
        decode = (steps * self.weight_bytes_read(num_prompts) + context_tokens * self.kv_bytes_per_token
                  + steps * num_prompts * self.state_bytes_per_request)
        return prefill + decode / ceilings.copy_bytes_per_s

    def step_seconds(self, context_tokens: int, ceilings: Ceilings = MEASURED_CEILINGS["NVIDIA H200"],
                     batch: int = 1) -> float:
        """Floor of one decode step of `batch` tokens over `context_tokens` cached tokens in all, on `ceilings`."""
        return (self.weight_bytes_read(batch) + context_tokens * self.kv_bytes_per_token
                + batch * self.state_bytes_per_request) / ceilings.copy_bytes_per_s
