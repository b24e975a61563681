"""Partial and interleaved rotary in the q/k norm + rope kernel (kernels/rotary.py): the first R = rotary_dim
elements of each head rotate (neox pairs (i, i + R/2), or GLM's / GPT-J's interleaved pairs (2i, 2i + 1)) and the
other D - R pass through. The Triton kernel (interpreter here; compiled in the `gpu` test) against the torch
reference, the reference against transformers' own `apply_rotary_pos_emb` of Phi-3 (Phi-4-mini's partial neox) and
GLM-4 (interleaved) bit for bit, and the fused KV-cache write against the separate one."""

from __future__ import annotations

import pytest
import torch
from helpers.tolerances import rounding_tol
from transformers.models.cohere import modeling_cohere
from transformers.models.deepseek_v2 import modeling_deepseek_v2
from transformers.models.ernie4_5 import modeling_ernie4_5
from transformers.models.glm4 import modeling_glm4
from transformers.models.phi3 import modeling_phi3

from replayllm.kernels.kv_cache_write import write_kv_cache_triton
from replayllm.kernels.rotary import KVWrite, qk_norm_rope_torch, qk_norm_rope_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (T, Hq, Hkv, D, R): Phi-4-mini's 96 of 128, a non-power-of-two pair count (20) and tail (24), StableLM's quarter
SHAPES = [(3, 4, 2, 128, 96), (5, 6, 2, 64, 40), (2, 4, 4, 32, 8), (4, 2, 1, 16, 16)]


def _case(num_tokens, num_heads, num_kv_heads, head_dim, rot_dim, dtype, norm, device="cpu", seed=0):
    """q/k/v as strided views of one qkv projection [T, (Hq + 2Hkv) * D]; cos/sin [P, R/2] fp32."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 2).to(dtype)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in
               qkv.to(device).split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.outer(torch.arange(300).float(), inv_freq)
    positions = torch.randint(0, 300, (num_tokens,), generator=g)
    weights = tuple((torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(device) for _ in range(2)) if norm \
        else (None, None)
    return positions.to(device), q, k, v, freqs.cos().to(device), freqs.sin().to(device), weights


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}-hq{}-hkv{}-d{}-r{}".format(*s))
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qknorm-rope"])
def test_triton_equals_the_reference(dtype, shape, interleaved, norm):
    positions, q, k, _, cos, sin, (qw, kw) = _case(*shape, dtype=dtype, norm=norm)
    got = qk_norm_rope_triton(positions, q, k, cos, sin, qw, kw, 1e-6, interleaved=interleaved)
    ref = qk_norm_rope_torch(positions, q, k, cos, sin, qw, kw, 1e-6, interleaved=interleaved)
    rot_dim = shape[4]
    for a, b, src in zip(got, ref, (q, k)):
        assert a.shape == b.shape and not a.isnan().any()
        a, b = a.view(src.shape), b.view(src.shape)
        if not norm:
            # No reduction: the same operations and roundings in the same order, the tail copied.
            assert torch.equal(a, b)
            assert torch.equal(a[..., rot_dim:], src[..., rot_dim:])
        elif dtype == torch.float32:
            # The per-head mean of squares in another order (head_dim terms), then the norm and the rotation.
            tol = rounding_tol(1, terms=shape[3], steps=2)
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        else:
            # The mean in another order (fp32 ulps): a normed element on a rounding boundary may move one ulp
            # of the half dtype, carried by the rotation's roundings (the same bound as the full-rotary test).
            assert (a.float() - b.float()).abs().max() <= 4 * torch.finfo(dtype).eps * b.abs().max().float()
            assert (a != b).float().mean() < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["phi3-neox", "glm4-interleaved"])
def test_the_reference_is_transformers_rotation(dtype, interleaved):
    """Bit for bit transformers' apply_rotary_pos_emb over its cos/sin layout: Phi-3's cat(freqs, freqs) cut to R,
    GLM-4's cat(freqs, freqs) whose first half it repeat_interleaves itself."""
    positions, q, k, _, cos, sin, _ = _case(4, 4, 2, 64, 32, dtype, norm=False)
    q_ref, k_ref = qk_norm_rope_torch(positions, q, k, cos, sin, interleaved=interleaved)
    hf_cos = torch.cat((cos, cos), -1)[positions].to(dtype)[None]  # [1, T, R] as the HF rotary module returns
    hf_sin = torch.cat((sin, sin), -1)[positions].to(dtype)[None]
    apply = (modeling_glm4 if interleaved else modeling_phi3).apply_rotary_pos_emb
    # HF's layout [B, H, T, D]; unsqueeze_dim=1 broadcasts cos over heads.
    q_hf, k_hf = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    assert torch.equal(q_ref.view(4, 4, 64), q_hf[0].transpose(0, 1))
    assert torch.equal(k_ref.view(4, 2, 64), k_hf[0].transpose(0, 1))
    assert not torch.equal(q_ref.view(4, 4, 64)[..., :32], q[..., :32])  # the rotation did rotate


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_math_is_coheres_rotation(dtype):
    """fp32_math (Cohere): q and the model-dtype cos/sin upcast, the rotation in fp32, one rounding. The reference is
    transformers' Cohere apply_rotary_pos_emb bit for bit (its interleaved pairs, repeat_interleave'd cos/sin), the
    kernel (interpreter) the reference; and it is not the per-op rounding of the other models."""
    positions, q, k, _, cos, sin, _ = _case(5, 4, 2, 32, 32, dtype, norm=False)
    got = qk_norm_rope_triton(positions, q, k, cos, sin, interleaved=True, fp32_math=True)
    ref = qk_norm_rope_torch(positions, q, k, cos, sin, interleaved=True, fp32_math=True)
    hf_cos = torch.repeat_interleave(cos, 2, -1)[positions].to(dtype)[None]  # [1, T, D]: CohereRotaryEmbedding's
    hf_sin = torch.repeat_interleave(sin, 2, -1)[positions].to(dtype)[None]
    q_hf, k_hf = modeling_cohere.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos,
                                                      hf_sin)
    assert torch.equal(ref[0].view(5, 4, 32), q_hf[0].transpose(0, 1))
    assert torch.equal(ref[1].view(5, 2, 32), k_hf[0].transpose(0, 1))
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    per_op = qk_norm_rope_torch(positions, q, k, cos, sin, interleaved=True)
    assert not torch.equal(per_op[0], ref[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_tables_are_ernies_and_deepseek_v2s_rotation(dtype):
    """fp32_tables (Ernie 4.5, DeepSeek-V2): the fp32 cos/sin unrounded times the upcast q, one rounding: transformers'
    Ernie 4.5 apply_rotary_pos_emb and DeepSeek-V2's complex rotation (its output pairs interleaved, as ours) bit for
    bit; the kernel (interpreter) the reference; and it is not Cohere's (cos/sin rounded first)."""
    positions, q, k, _, cos, sin, _ = _case(5, 4, 2, 32, 32, dtype, norm=False)
    got = qk_norm_rope_triton(positions, q, k, cos, sin, interleaved=True, fp32_math=True, fp32_tables=True)
    ref = qk_norm_rope_torch(positions, q, k, cos, sin, interleaved=True, fp32_math=True, fp32_tables=True)
    emb = torch.cat([cos, cos], -1)[positions][None], torch.cat([sin, sin], -1)[positions][None]  # [1, T, D] fp32
    q_hf, k_hf = modeling_ernie4_5.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], *emb)
    assert torch.equal(ref[0].view(5, 4, 32), q_hf[0].transpose(0, 1))
    assert torch.equal(ref[1].view(5, 2, 32), k_hf[0].transpose(0, 1))
    freqs_cis = torch.complex(cos, sin)[positions][None]  # [1, T, D/2]: DeepseekV2RotaryEmbedding's
    q_ds, k_ds = modeling_deepseek_v2.apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs_cis)
    assert torch.equal(ref[0].view(5, 4, 32), q_ds[0].transpose(0, 1))
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    rounded = qk_norm_rope_torch(positions, q, k, cos, sin, interleaved=True, fp32_math=True)
    assert not torch.equal(rounded[0], ref[0])
    with pytest.raises(ValueError, match="fp32_tables .* needs fp32_math"):
        qk_norm_rope_torch(positions, q, k, cos, sin, fp32_tables=True)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                (torch.bfloat16, torch.float8_e4m3fn)], ids=str)
def test_the_fused_kv_write_equals_the_separate_write(interleaved, dtype, cache_dtype):
    """The pass-through tail of K and every element of V reach the cache too (a 40-of-64 rotary)."""
    positions, q, k, v, cos, sin, (qw, kw) = _case(7, 4, 2, 64, 40, dtype, norm=True, seed=3)
    slots = torch.randperm(4 * 4)[:7]
    fused = torch.zeros(2, 4, 4, 2, 64, dtype=cache_dtype)
    separate = torch.zeros_like(fused)
    q_fused, k_none = qk_norm_rope_triton(positions, q, k, cos, sin, qw, kw, 1e-6,
                                          kv_write=KVWrite(fused, v, slots), interleaved=interleaved)
    q_sep, k_sep = qk_norm_rope_triton(positions, q, k, cos, sin, qw, kw, 1e-6, interleaved=interleaved)
    write_kv_cache_triton(separate, k_sep.view(7, 2, 64), v, slots)
    assert k_none is None and torch.equal(q_fused, q_sep)
    assert torch.equal(fused.view(torch.uint8), separate.view(torch.uint8))
    written = fused.view(2, 16, 2, 64)[:, slots]  # [2, T, Hkv, D]
    assert (written[..., 40:].float() != 0).float().mean() > 0.9  # the tails were written, K's and V's


def test_a_rotary_wider_than_the_head_is_refused():
    positions, q, k, _, cos, sin, _ = _case(2, 2, 1, 16, 16, torch.float32, norm=False)
    wide = torch.cat((cos, cos), -1).contiguous()  # [P, 16] pairs for a 16-wide head
    for fn in (qk_norm_rope_triton, qk_norm_rope_torch):
        with pytest.raises(ValueError, match="rotary_dim <= head_dim"):
            fn(positions, q, k, wide, wide)
        with pytest.raises(ValueError, match="cos and sin alike"):
            fn(positions, q, k, cos, sin[:, :4].contiguous())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernel)")
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_compiled_kernel_equals_the_reference(interleaved, dtype):
    """bf16: bit for bit (every product and sum rounds to bf16 in both). fp32: the compiler contracts x1 * cos -
    x2 * sin into an FMA (one rounding where torch has three), so within those roundings of the products'
    magnitude; the unrotated tail is a copy either way."""
    for shape in SHAPES:
        positions, q, k, _, cos, sin, _ = _case(*shape, dtype=dtype, norm=False, device="cuda")
        got = qk_norm_rope_triton(positions, q, k, cos, sin, interleaved=interleaved)
        ref = qk_norm_rope_torch(positions, q, k, cos, sin, interleaved=interleaved)
        for a, b, src in zip(got, ref, (q, k)):
            a, b = a.view(src.shape), b.view(src.shape)
            assert torch.equal(a[..., shape[4]:], src[..., shape[4]:]), shape
            if dtype == torch.bfloat16:
                assert torch.equal(a, b), shape
            else:
                tol = rounding_tol(src.abs().max(), steps=3)
                torch.testing.assert_close(a, b, rtol=0, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernel)")
@pytest.mark.parametrize("tables", [False, True], ids=["cohere", "fp32-tables"])
def test_compiled_fp32_math_rotation_is_within_a_rounding_of_the_reference(tables):
    """Cohere's fp32 rotation (and DeepSeek-V2's / Ernie's, with fp32 tables) compiled: the compiler may contract
    x1 * cos - x2 * sin into an FMA (one rounding fewer in fp32), so an element on a bf16 rounding boundary may move
    one bf16 ulp; nearly all are equal."""
    positions, q, k, _, cos, sin, _ = _case(64, 8, 2, 128, 128, torch.bfloat16, norm=False, device="cuda")
    got = qk_norm_rope_triton(positions, q, k, cos, sin, interleaved=True, fp32_math=True, fp32_tables=tables)
    ref = qk_norm_rope_torch(positions, q, k, cos, sin, interleaved=True, fp32_math=True, fp32_tables=tables)
    for a, b in zip(got, ref):
        assert (a.float() - b.float()).abs().max() <= torch.finfo(torch.bfloat16).eps * b.float().abs().max()
        assert (a != b).float().mean() < 0.01
