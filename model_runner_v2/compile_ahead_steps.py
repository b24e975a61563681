"""Start-up on CUDA: the Triton variants of the eager steps compiled ahead, on a thread pool.

The warm-up (engine/warm_up.py) runs real requests so that nothing compiles inside a user's run; on a fresh
machine it met its ~10 variants one at a time (~0.6 s each: prefill attention per query tile, the logprobs
kernels per top-k width). Before it, `compile_eager_steps` runs the same launches with throw-away inputs under
`kernels.compile_ahead` (compile, don't launch): a forward of one sequence per query-length class in the sink
block, the logprobs kernels for every k the warm-up asks for, and the append of sampled tokens (launched outside
the graphs after every step: without it, an engine built with the warm-up off met that compile inside the
user's first run). The warm-up then finds them compiled; it stays what guarantees coverage (a variant missed
here compiles there, as before).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import EngineConfig
from ..kernels import append_sampled
from ..kernels.compile_ahead import compile_ahead
from ..kernels.dispatch import use_fused_kernels
from ..kernels.logprobs import raw_logprobs, warm_up_ks
from .forward_context import AttentionMetadata, ForwardContext, set_forward_context

# One sequence per class of the prefill kernel's query tile (next power of two of the longest query), as the
# warm-up's requests alone (engine/warm_up.py _ALONE_PROMPT_LENS); 1 is a decode step run eagerly.
QUERY_LENS = (1, 2, 5, 9, 17, 33, 65)


@torch.inference_mode()
def compile_eager_steps(model: nn.Module, kv_caches: list[torch.Tensor], config: EngineConfig,
                        sink_block: int, token_ids_width: int | None = None) -> None:
    """CUDA only (nothing elsewhere). Every input lives in the sink block; nothing is written (compile only).
    token_ids_width: RequestStates.token_ids' row length (its append kernel's variant; None: not compiled)."""
    device = config.torch_device
    if device.type != "cuda":
        return
    i64 = dict(dtype=torch.int64, device=device)
    with compile_ahead(device, "eager steps"):
        for n in (q for q in QUERY_LENS if q <= config.max_model_len):
            positions = torch.arange(n, **i64)
            blocks = -(-n // config.block_size)
            md = AttentionMetadata(
                query_start_loc=torch.tensor([0, n], **i64), seq_lens=torch.tensor([n], **i64),
                slot_mapping=sink_block * config.block_size + positions % config.block_size,
                block_tables=torch.full((1, blocks), sink_block, dtype=torch.int32, device=device),
                token_req_idx=torch.zeros(n, **i64), positions=positions, max_query_len=n, max_seq_len=n,
                req_slots=torch.full((1,), config.max_num_seqs, **i64))  # the pad slot (request_states.py)
            with set_forward_context(ForwardContext(md, kv_caches, config.attention_backend)):
                model(torch.zeros(n, **i64), positions)
        mc = config.model_config
        logits_dtype = torch.float32 if config.enable_fp32_lm_head else mc.dtype
        logits = torch.zeros(2, mc.vocab_size, dtype=logits_dtype, device=device)
        ids = torch.zeros(2, **i64)
        for k in warm_up_ks(mc.vocab_size, config.max_logprobs):
            raw_logprobs(logits, ids, k, with_lse=True)
        if token_ids_width is not None and append_sampled.ENABLED and use_fused_kernels(device):
            # Throw-away tensors of the real ones' shapes and dtypes (same variant): where compile-ahead is off
            # (older Triton), this launch runs, and writes nothing the engine reads.
            token_ids = torch.zeros(1, token_ids_width, dtype=torch.int32, device=device)
            append_sampled.append_sampled_triton(token_ids, torch.zeros(1, dtype=torch.int32, device=device),
                                                 torch.zeros(1, **i64), torch.zeros(1, **i64))
