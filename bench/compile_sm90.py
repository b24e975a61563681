"""Compile the attention, KV-write and rope kernels for an sm_90 (H200) target in this process, no GPU needed.

Usage: python bench/compile_sm90.py                      (the Triton this environment imports)
       python bench/compile_sm90.py --aligned-only       (only the aligned variants, the ones the GPU runs on the
                                                          real models: half the time; the CPU suite's choice)
       PYTHONPATH=/tmp/t36 python bench/compile_sm90.py   (another Triton, e.g. the device's 3.6.0 unpacked there:
                                                          `pip install --no-deps --target /tmp/t36 triton==3.6.0`)
The Triton interpreter runs kernels the GPU compiler refuses (it ran the fused rope + KV-write kernel with a
branch-typing error that sm_90 compilation caught), and Triton versions differ in what they accept: this compiles
the kernels a session changed for the device's target before a device call is spent on them. What it builds: the
bf16 prefill kernel (both grid numberings live in one variant) and decode kernel (split and not, the split
one with and without its fused reduce) over bf16, e4m3
and e5m2 caches; the fp8 KV write, alone and fused into the q/k norm + rope kernel; that rope kernel over a bf16
cache (the engine's default path) and without a cache, and with Phi-4-mini's partial and GLM's interleaved rotary
(and Cohere's in fp32); the sliding-window variants of the prefill and split decode kernels, and Gemma 2's with
capped scores too; Gemma's RMSNorm and GeGLU; the LayerNorm (+ residual) kernel; GPT-OSS's attention sinks (prefill,
every decode form, the reduce) and its experts' biases and clamped SwiGLU in the fused MoE GEMMs; each with and
without the alignment facts a launch of aligned tensors gets (`build`). Checks that the fp8 variants' dots use the bf16
variant's operand layouts. Prints the Triton version, then OK (exit 1 on a failure).
tests/kernels/test_fp8_kv_cache.py runs it with the local Triton, --aligned-only (~30 s of a 2-core CI box; both
variants: ~80 s)."""

from __future__ import annotations

import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compiled, not interpreted

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from replayllm.kernels import activation, fused_moe, layer_norm, rms_norm, rotary  # noqa: E402
from replayllm.kernels import kv_cache_write as kw  # noqa: E402
from replayllm.kernels import paged_attention as pa  # noqa: E402

STRIDES = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kv", "stride_kb", "stride_ks", "stride_kh",
           "stride_bt", "stride_kt", "stride_vt", "stride_vh", "stride_x", "stride_r")
TYPES = dict(out_ptr="*bf16", part_acc_ptr="*fp32", part_ml_ptr="*fp32", q_ptr="*bf16", block_tables_ptr="*i32",
             counter_ptr="*i32", query_start_loc_ptr="*i64", seq_lens_ptr="*i64", scale_log2="fp32",
             min_split_len="i32", window="i32", softcap="fp32", num_reqs="i32", blocks_per_req="i32", k_ptr="*bf16",
             v_ptr="*bf16", slot_ptr="*i64", H="i32",
             q_out_ptr="*bf16", k_out_ptr="*bf16", q_w_ptr="*bf16", k_w_ptr="*bf16", pos_ptr="*i64",
             cos_ptr="*fp32", sin_ptr="*fp32", Hq="i32", Hkv="i32", eps="fp32", res_out_ptr="*bf16", x_ptr="*bf16",
             res_ptr="*bf16", w_ptr="*bf16", first_w_ptr="*bf16", first_eps="fp32", b_ptr="*bf16", N="i32", I="i32",
             sinks_ptr="*bf16", alibi_ptr="*fp32", num_splits="i32",
             # the fused MoE GEMMs
             h_ptr="*bf16", y_ptr="*bf16", w13_ptr="*bf16", w2_ptr="*bf16", b13_ptr="*bf16", b2_ptr="*bf16",
             sorted_ids_ptr="*i32", block_expert_ptr="*i32", num_rows_ptr="*i32", num_copies="i32", num_pid_m="i32",
             alpha="fp32", limit="fp32", stride_xt="i64", stride_we="i64", stride_wn="i64",
             **{n: "i64" for n in STRIDES})
ATTENTION = dict(GROUP=2, BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PAD=128, UPCAST=False, SLIDING=False,
                 SOFTCAP=False, SINKS=False, ALIBI=False, CHUNKED=False)  # Qwen3-0.6B
ROPE = dict(NORM=True, DTYPE=1, HEAD_DIM=128, HQ_PAD=16, HKV_PAD=8, HALF=64, HALF_PAD=64, INTERLEAVED=False,
            PASS_PAD=0, PDL=True, ROPE_FP32=False, TABLES_FP32=False, NORM_WEIGHT_FP32=False, NORM_UNIT_OFFSET=False)
# Phi-4-mini's 96-of-128 neox rotary and GLM's interleaved half rotary (the unrotated tails stored too)
PARTIAL_ROPES = (dict(ROPE, NORM=False, HALF=48, PASS_PAD=32), dict(ROPE, NORM=False, HALF=32, HALF_PAD=32,
                                                                     INTERLEAVED=True, PASS_PAD=64))


def build(kernel, kv_type: str, constexprs: dict, aligned: bool):
    """The kernel compiled for sm_90 with these constexprs; kv_ptr of type kv_type; every other argument typed by
    TYPES. aligned: the pointers and strides marked divisible by 16, as Triton specialises a launch whose values
    are (torch's allocations and the real models' strides): that is the variant the GPU runs, with vectorised
    loads and software pipelining, and the one a change can break (a runtime branch in the attention tile's
    softmax compiled without these facts and failed with them, session 23). Without them: odd shapes' variant."""
    types = dict(TYPES, kv_ptr=kv_type)
    sig = {n: "constexpr" if n in constexprs else types[n] for n in kernel.arg_names}
    consts = {(i,): constexprs[n] for i, n in enumerate(kernel.arg_names) if n in constexprs}
    unspecialised = {kernel.arg_names[a] if isinstance(a, int) else a for a in kernel.do_not_specialize or ()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if aligned and n not in constexprs and n not in unspecialised
             and (types[n].startswith("*") or n.startswith("stride"))}
    return triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 3})


def main() -> None:
    print("triton", triton.__version__)
    for aligned in (True,) if "--aligned-only" in sys.argv[1:] else (True, False):
        build_all(aligned)
    print("OK")


def build_all(aligned: bool) -> None:
    def ptx(kernel, kv, constexprs) -> str:
        return build(kernel, kv, constexprs, aligned).asm["ptx"]

    layouts = {}  # cache type -> the dot operand layouts (kWidth) of its attention kernels
    for kv, fp8 in (("*bf16", 0), ("*fp8e4nv", 1), ("*fp8e5", 2)):
        code, ttgir = "", ""
        for kernel, constexprs in ((pa._paged_prefill_kernel, dict(ATTENTION, GROUP_PAD=2, BLOCK_Q=32, BLOCK_N=64)),
                                   *((pa._paged_decode_kernel, dict(ATTENTION, SPLIT=split, GROUP_PAD=16, BLOCK_N=64,
                                                                    PDL=True, FUSED_REDUCE=fused,
                                                                    SPLITS_PAD=pa.DECODE_SPLITS_PAD if fused else 1))
                                     for split, fused in ((False, False), (True, False), (True, True)))):
            built = build(kernel, kv, constexprs, aligned)
            code, ttgir = code + built.asm["ptx"], ttgir + built.asm["ttgir"]
        # e4m3 tiles are converted on the GPU by cvt (e5m2: by bit shifts)
        assert fp8 != 1 or "e4m3x2" in code, "no e4m3 conversion in the fp8 attention kernels"
        # An fp8 cache's dots take the 16-bit operand layout, as over a bf16 cache: the same products in the same
        # MMA slots, hence the widened cache's bits (kernels/attention_tile.py widen; 8-bit operands get kWidth 4)
        layouts[kv] = sorted(set(re.findall(r"kWidth = \d+", ttgir)))
        assert layouts[kv] == layouts["*bf16"], f"{kv} attention dots use {layouts[kv]}, bf16's {layouts['*bf16']}"
        if fp8:
            ptx(kw._write_kv_cache_kernel, kv, dict(DTYPE=0, FP8=fp8, HEAD_DIM=128, H_PAD=8, D_PAD=128, PDL=True))
        ptx(rotary._qk_norm_rope_kernel, kv, dict(ROPE, CACHE=True, KV_DTYPE=0 if fp8 else 1, KV_FP8=fp8))
    ptx(rotary._qk_norm_rope_kernel, "*bf16", dict(ROPE, CACHE=False, KV_DTYPE=1, KV_FP8=0))
    for rope in PARTIAL_ROPES:
        ptx(rotary._qk_norm_rope_kernel, "*bf16", dict(rope, CACHE=True, KV_DTYPE=1, KV_FP8=0))
    # Gemma-3-1B's heads (4 q, 1 KV, 256 wide) with its (1 + weight) q/k norms, and OLMo 2's fp32-weight order
    for unit_offset in (True, False):
        ptx(rotary._qk_norm_rope_kernel, "*bf16", dict(ROPE, HEAD_DIM=256, HQ_PAD=4, HKV_PAD=1, HALF=128, HALF_PAD=128,
                                                      NORM_WEIGHT_FP32=True, NORM_UNIT_OFFSET=unit_offset,
                                                      CACHE=True, KV_DTYPE=1, KV_FP8=0))
    # Cohere's interleaved rotary in fp32 with one rounding
    ptx(rotary._qk_norm_rope_kernel, "*bf16", dict(ROPE, NORM=False, INTERLEAVED=True, ROPE_FP32=True, CACHE=True,
                                                  KV_DTYPE=1, KV_FP8=0))
    # DeepSeek-V2's MLA heads: 32 interleaved pairs of 192 elements (a 128-wide tail), fp32 rotation and tables, one
    # KV head a q head (16 of each); its 192-wide heads in the attention kernels (padded to 256)
    ptx(rotary._qk_norm_rope_kernel, "*bf16", dict(ROPE, NORM=False, HEAD_DIM=192, HKV_PAD=16, HALF=32, HALF_PAD=32,
                                                  INTERLEAVED=True, PASS_PAD=128, ROPE_FP32=True, TABLES_FP32=True,
                                                  CACHE=True, KV_DTYPE=1, KV_FP8=0))
    mla = dict(ATTENTION, GROUP=1, HEAD_DIM=192, HEAD_DIM_PAD=256)
    ptx(pa._paged_prefill_kernel, "*bf16", dict(mla, GROUP_PAD=1, BLOCK_Q=64, BLOCK_N=32))
    ptx(pa._paged_decode_kernel, "*bf16", dict(mla, SPLIT=True, GROUP_PAD=16, BLOCK_N=32, PDL=True,
                                               FUSED_REDUCE=False, SPLITS_PAD=1))
    # sliding-window attention's variants (Mistral / Phi-3 / Qwen2 windows past W: the default max_model_len)
    ptx(pa._paged_prefill_kernel, "*bf16", dict(ATTENTION, SLIDING=True, GROUP_PAD=2, BLOCK_Q=32, BLOCK_N=64))
    ptx(pa._paged_decode_kernel, "*bf16", dict(ATTENTION, SLIDING=True, SPLIT=True, GROUP_PAD=16, BLOCK_N=64,
                                                PDL=True, FUSED_REDUCE=False, SPLITS_PAD=1))
    # Llama 4's chunked layers (Scout: 40 q heads on 8 kv heads of 128): the chunk variants of prefill and decode, its
    # interleaved fp32 rope over fp32 tables without the cache write, then the L2 norms with the identity rotation
    # writing the cache (models/llama4.py RopeThenL2Norm)
    llama4 = dict(ATTENTION, GROUP=5, CHUNKED=True)
    ptx(pa._paged_prefill_kernel, "*bf16", dict(llama4, GROUP_PAD=8, BLOCK_Q=16, BLOCK_N=64))
    for split, fused in ((False, False), (True, False), (True, True)):
        ptx(pa._paged_decode_kernel, "*bf16", dict(llama4, SPLIT=split, GROUP_PAD=16, BLOCK_N=64, PDL=True,
                                                   FUSED_REDUCE=fused, SPLITS_PAD=pa.DECODE_SPLITS_PAD if fused else 1))
    ptx(rotary._qk_norm_rope_kernel, "*bf16", dict(ROPE, NORM=False, HQ_PAD=64, INTERLEAVED=True, ROPE_FP32=True,
                                                  TABLES_FP32=True, CACHE=False, KV_DTYPE=1, KV_FP8=0))
    ptx(rotary._qk_norm_rope_kernel, "*bf16", dict(ROPE, HQ_PAD=64, CACHE=True, KV_DTYPE=1, KV_FP8=0))
    # Gemma 2's capped scores (with its sliding window), head_dim 256
    gemma2 = dict(ATTENTION, HEAD_DIM=256, HEAD_DIM_PAD=256, SLIDING=True, SOFTCAP=True)
    ptx(pa._paged_prefill_kernel, "*bf16", dict(gemma2, GROUP_PAD=2, BLOCK_Q=16, BLOCK_N=32))
    ptx(pa._paged_decode_kernel, "*bf16", dict(gemma2, SPLIT=True, GROUP_PAD=16, BLOCK_N=32, PDL=True,
                                               FUSED_REDUCE=False, SPLITS_PAD=1))
    # Gemma's (1 + weight) RMSNorm after the residual add, and its GeGLU
    for first in (False, True):  # and Gemma 2 / 3's post-attention norm, add and pre-feedforward norm in one launch
        ptx(rms_norm._rms_norm_kernel, "*bf16", dict(HAS_RESIDUAL=True, WEIGHT_FP32=True, UNIT_OFFSET=True, DTYPE=1,
                                                     BLOCK=2048, FIRST_NORM=first))
    for affine in (True, False):  # with weight, bias and Nemotron's unit offset; OLMo's parameter-free norm
        ptx(layer_norm._layer_norm_kernel, "*bf16", dict(HAS_RESIDUAL=True, HAS_WEIGHT=affine, HAS_BIAS=affine,
                                                         UNIT_OFFSET=affine, DTYPE=1, BLOCK=8192))
    ptx(activation._act_and_mul_kernel, "*bf16", dict(DTYPE=1, BLOCK=1024, GELU_TANH=True))
    # GPT-OSS: attention sinks (head_dim 64, 8 q heads a kv head, a 128-token window in every other layer) in the
    # prefill kernel and every decode form (one split; split with the reduce kernel; split with the fused reduce);
    # its experts' biases and clamped SwiGLU in the fused MoE GEMMs
    oss = dict(ATTENTION, GROUP=8, HEAD_DIM=64, HEAD_DIM_PAD=64, SINKS=True)
    for sliding in (False, True):
        ptx(pa._paged_prefill_kernel, "*bf16", dict(oss, SLIDING=sliding, GROUP_PAD=8, BLOCK_Q=16, BLOCK_N=64))
        for split, fused in ((False, False), (True, False), (True, True)):
            ptx(pa._paged_decode_kernel, "*bf16", dict(oss, SLIDING=sliding, SPLIT=split, GROUP_PAD=16, BLOCK_N=64,
                                                       PDL=True, FUSED_REDUCE=fused,
                                                       SPLITS_PAD=pa.DECODE_SPLITS_PAD if fused else 1))
    ptx(pa._paged_decode_reduce_kernel, "*bf16", dict(SPLITS_PAD=32, HEAD_DIM=64, HEAD_DIM_PAD=64, PDL=True,
                                                      NUM_HEADS=64, ROWS=8, SINKS=True))
    # BLOOM's ALiBi (bloom-560m: 16 heads of 64, one q head a kv head) in the prefill kernel and the decode forms
    bloom = dict(ATTENTION, GROUP=1, HEAD_DIM=64, HEAD_DIM_PAD=64, ALIBI=True)
    ptx(pa._paged_prefill_kernel, "*bf16", dict(bloom, GROUP_PAD=1, BLOCK_Q=64, BLOCK_N=64))
    for split in (False, True):
        ptx(pa._paged_decode_kernel, "*bf16", dict(bloom, SPLIT=split, GROUP_PAD=16, BLOCK_N=64, PDL=True,
                                                   FUSED_REDUCE=False, SPLITS_PAD=1))
    moe = dict(DTYPE=1, UPCAST=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, HAS_BIAS=True)
    gated = dict(RELU2=False, CLAMP_SILU=False, CLIP_SILU=False, GELU_TANH=False)
    ptx(fused_moe._moe_gemm1_kernel, "*bf16", dict(moe, **gated, TOPK=4, CLAMPED=True))
    # NemotronH's ungated ReLU² experts, Gemma 4's GeGLU ones, HY-V4's clamped and Ling 3's clipped SwiGLU (no biases)
    plain = dict(moe, **gated, HAS_BIAS=False, TOPK=6, CLAMPED=False)
    for branch in ("RELU2", "GELU_TANH", "CLAMP_SILU", "CLIP_SILU"):
        ptx(fused_moe._moe_gemm1_kernel, "*bf16", dict(plain, **{branch: True}))
    ptx(fused_moe._moe_gemm2_kernel, "*bf16", moe)


if __name__ == "__main__":
    main()
