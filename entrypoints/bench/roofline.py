"""The bandwidth/compute floor of a benchmark run: decode steps move the weights plus every context token's
K/V once; prefill is counted as matrix FLOPs. Ceilings are the H200's measured ones (docs/benchmarks.md).

Mixture-of-experts models: a step reads only the experts its tokens were routed to. With B tokens of top-k routing
spread evenly over E experts (dummy weights route near-uniformly), a layer's expert is hit with probability
1 - (1 - k/E)^B, so a step reads that share of the expert weights (all of them from B ~ 4E/k tokens on); a prefill
token costs the FLOPs of its k experts only."""

from __future__ import annotations

from dataclasses import dataclass

H200_COPY_BYTES_PER_S = 4.25e12  # device-to-device copy, bytes read + written, measured on the lent H200
H200_BF16_FLOPS = 7.9e14  # 8192^3 bf16 matmul through torch, random data, measured there


@dataclass(frozen=True)
class ModelCost:
    """What one token costs a model: bytes of weights read per decode step, K/V bytes per context token
    (all layers, K and V), and matrix FLOPs per prefill token (2 x the decoder layers' weights)."""

    weight_bytes: int  # every weight read once per step, routed experts excluded
    kv_bytes_per_token: int
    flops_per_token: int  # routed experts: their top_k / num_experts share
    head_flops: int  # 2 x lm_head weights: paid once per sampled token
    expert_bytes: int = 0  # MoE: the routed experts' weights, all layers (read as far as tokens hit them)
    expert_hit_rate: float = 0.0  # MoE: top_k / num_experts, one token's chance to hit a given expert

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
        kv = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * engine.config.kv_cache_torch_dtype.itemsize
        return cls(weight_bytes * tp, kv, int(layer_flops * tp), 2 * head_params * tp, expert_bytes * tp, hit)

    def run_seconds(self, num_prompts: int, input_len: int, output_len: int,
                    bandwidth: float = H200_COPY_BYTES_PER_S, flops: float = H200_BF16_FLOPS) -> float:
        """Floor for num_prompts x (input_len in, output_len out): prefill FLOPs at `flops` (the first token
        comes from prefill), then output_len - 1 decode steps whose bytes go at `bandwidth`; decode step i
        reads every request's input_len + i cached tokens."""
        prefill = (num_prompts * input_len * self.flops_per_token + num_prompts * self.head_flops) / flops
        steps = output_len - 1
        context_tokens = num_prompts * (steps * input_len + steps * (steps + 1) // 2)
        decode = (steps * self.weight_bytes_read(num_prompts) + context_tokens * self.kv_bytes_per_token) / bandwidth
        return prefill + decode

    def step_seconds(self, context_tokens: int, bandwidth: float = H200_COPY_BYTES_PER_S, batch: int = 1) -> float:
        """Floor of one decode step of `batch` tokens over `context_tokens` cached tokens in all."""
        return (self.weight_bytes_read(batch) + context_tokens * self.kv_bytes_per_token) / bandwidth
